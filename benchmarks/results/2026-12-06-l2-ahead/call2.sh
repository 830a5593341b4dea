#!/usr/bin/env bash
# Session 2026-12-06 #3, call 1: o asks L2 for a share of gate/up (OURO_L2_AHEAD=0/1): kernel tests, rounds
# (roofline), ouro-bench C1/C2 A/B/A/B; C8 with the loop tune's 8-row choices against the table; the share in the loop.
set -u
DL=${DL:-560}
source benchmarks/device_call.sh s3c1
export PYTHONPATH=$PWD
t; cat $R/host.txt
timeout $(cap 90) python3 -m pytest -q tests/test_kernels.py -k "l2 or linear_matches or table_configs or glu" > $R/kernel_tests.log 2>&1; tail -1 $R/kernel_tests.log; t
rl() { OURO_L2_AHEAD=$1 timeout $(cap 50) python3 benchmarks/roofline.py --hbm-tb-s $HBM --label l2$1 --out $R/roofline_l2$1_$2.json > $R/roofline_l2$1_$2.log 2>&1; python3 -c "import json;d=json.load(open('$R/roofline_l2$1_$2.json'));print('l2=$1',d['decode_loop'])"; }
rl 0 a; rl 1 a; t
B="--shape ouro-1.4b --baseline none --input-len 128 --output-len 64 --repeats 2 --workload full --concurrency 1 2"
for side in 0 1 0b 1b; do
  [ $(left) -lt 150 ] && { echo "skip l2$side"; continue; }
  OURO_L2_AHEAD=${side:0:1} timeout $(cap 60) python3 -m ouro_backend.entrypoints.bench $B --label l2$side --out $R/bench_l2$side.json > $R/bench_l2$side.log 2>&1; echo "l2$side $(t)"; grep -E "^(full|thr)" $R/bench_l2$side.log | cut -c1-100 | head -2
done
[ $(left) -gt 150 ] && { rl 1 b; rl 0 b; t; }
B8="--shape ouro-1.4b --baseline none --input-len 128 --output-len 64 --repeats 2 --workload full --concurrency 8"
for side in table tune; do
  [ $(left) -lt 60 ] && { echo "skip $side"; continue; }
  if [[ $side == tune* ]]; then cmd="benchmarks/kernels/bench_with_tune.py .calls/r1/c1/tune.json"; else cmd="-m ouro_backend.entrypoints.bench"; fi
  timeout $(cap 45) python3 $cmd $B8 --label $side --out $R/bench8_$side.json > $R/bench8_$side.log 2>&1; echo "$side $(t)"; grep -E "^(full|thr)" $R/bench8_$side.log | cut -c1-100 | head -1
done
N=l2_gate_up_0,l2_gate_up_20,l2_gate_up_30,probe_no_norms,probe_no_attention
[ $(left) -gt 60 ] && { timeout $(cap 80) python3 benchmarks/kernels/loop_bench.py variants --rows 1,2 --replays 40 --names $N --out $R/variants.json > $R/variants.log 2>&1; cut -c1-100 $R/variants.log | grep M=; t; }
[ $(left) -gt 40 ] && { timeout $(( $(left) - 8 )) python3 -m pytest -q tests/test_gpu.py -k "greedy_equals_oracle" > $R/gpu_tests.log 2>&1; tail -3 $R/gpu_tests.log; t; }
