#!/usr/bin/env bash
# Session 2026-12-07 #7, call C (issue 25 on the H200, main b3e316b): served through tritonserver against
# engine-direct on the same prompt ids, C64, 512 requests, full depth and the gate (threshold 0.172), with
# perf_analyzer; TTFT p50 on both sides. From the repository root, carrying .device-bundle.
set -u
DL=${DL:-540}
source benchmarks/device_call.sh cC
t; cat $R/host.txt
export PYTHONPATH=$PWD
source .device-bundle/activate.sh > $R/activate.log 2>&1
timeout -k 5 $(cap 120) python3 -c "from ouro_backend.entrypoints.bench import ensure_shape_checkpoint as e; print(e('ouro-1.4b'))" > $R/checkpoint.log 2>&1; tail -1 $R/checkpoint.log; t
s() {  # label cap args...
  local l=$1 c=$2; shift 2
  echo "+ python3 benchmarks/served.py --concurrency 64 --requests 512 --repeats 1 $*" > $R/served_$l.log
  timeout -k 5 $(cap $c) python3 benchmarks/served.py --concurrency 64 --requests 512 --repeats 1 "$@" --out /tmp/e_$l >> $R/served_$l.log 2>&1
  echo "$l rc=$? $(t)"
  mkdir -p $R/$l; cp /tmp/e_$l/served_summary.json /tmp/e_$l/perf_analyzer/ouro_c64.requests.json $R/$l/ 2>/dev/null
  python3 -c "
import json;d=json.load(open('$R/$l/served_summary.json'))
print({k:v for k,v in d.items() if not isinstance(v,(dict,list)) and ('tok_s' in k or 'ratio' in k or 'depth' in k)}); print('ttft', d.get('ttft_p50_ms'))" 2>&1 | cut -c1-1200
}
s full 260 --port-base 19500
s gate 240 --exit-threshold 0.172 --port-base 19600
t
