#!/usr/bin/env bash
# Session 2026-12-07 #9, call A (issue 25 on the H200, main c3a488c): the serving path alone (stand-in engine)
# at 64 and 256 streams, then C256 64/64 served against engine-direct on the same prompt ids, full depth and the
# gate (threshold 0.1875, depth ~1.6 in 2026-12-04's runs), no perf_analyzer (its target is at C64).
# From the repository root, carrying .device-bundle.
set -u
DL=${DL:-570}
source benchmarks/device_call.sh cA
t; cat $R/host.txt; nproc >> $R/host.txt
export PYTHONPATH=$PWD
source .device-bundle/activate.sh > $R/activate.log 2>&1
timeout -k 5 $(cap 120) python3 -c "from ouro_backend.entrypoints.bench import ensure_shape_checkpoint as e; print(e('ouro-1.4b'))" > $R/checkpoint.log 2>&1 &
summ() {  # dir
  python3 -c "
import json;d=json.load(open('$1/served_summary.json'))
print({k:v for k,v in d.items() if not isinstance(v,(dict,list)) and ('tok_s' in k or 'ratio' in k or 'depth' in k or 'ttft' in k or 'responses' in k or 'in_flight' in k)})" 2>&1 | cut -c1-1200
}
st() {  # streams cap
  local c=$1 cap_s=$2
  echo "+ python3 benchmarks/served.py --model ouro_backend/models/ouro-demo --stand-in --trace --concurrency $c --requests $((c*8)) --repeats 3 --skip-perf-analyzer --engine-arg device=cpu --engine-arg num_blocks=16384" > $R/standin_c$c.log
  timeout -k 5 $(cap $cap_s) python3 benchmarks/served.py --model ouro_backend/models/ouro-demo --stand-in --trace --concurrency $c \
    --requests $((c*8)) --repeats 3 --skip-perf-analyzer --engine-arg device=cpu --engine-arg num_blocks=16384 \
    --port-base $((19000 + c)) --out /tmp/st_$c >> $R/standin_c$c.log 2>&1
  echo "standin c$c rc=$? $(t)"
  mkdir -p $R/standin_c$c; cp /tmp/st_$c/served_summary.json /tmp/st_$c/served_ouro_*.json $R/standin_c$c/ 2>/dev/null
  summ $R/standin_c$c
}
st 64 90
st 256 110
wait; tail -1 $R/checkpoint.log; t
s() {  # label cap args...
  local l=$1 c=$2; shift 2
  echo "+ python3 benchmarks/served.py --concurrency 256 --requests 1024 --input-len 64 --output-len 64 --repeats 1 --skip-perf-analyzer $*" > $R/served_$l.log
  timeout -k 5 $(cap $c) python3 benchmarks/served.py --concurrency 256 --requests 1024 --input-len 64 --output-len 64 --repeats 1 \
    --skip-perf-analyzer "$@" --out /tmp/e_$l >> $R/served_$l.log 2>&1
  echo "$l rc=$? $(t)"
  mkdir -p $R/$l; cp /tmp/e_$l/served_summary.json /tmp/e_$l/direct.json /tmp/e_$l/served_ouro_*.json $R/$l/ 2>/dev/null
  summ $R/$l
}
s c256_full 170 --port-base 19500
s c256_gate 170 --exit-threshold 0.1875 --port-base 19600
t
