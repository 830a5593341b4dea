#!/usr/bin/env bash
# Issue 30: the fused greedy coda. GPU tests, the coda microbench sweep, then ouro-bench with the fused coda
# off (OURO_FUSED_CODA=0) and on, alternating, C1 C2 C8, full depth and gate 0.5.
set -u
source benchmarks/device_call.sh c1
export PYTHONPATH=$PWD
echo "HBM=$HBM"; t
timeout $(cap 150) python3 -m pytest -q tests/test_kernels.py -k "coda or advance or really_run" > $R/kernel_tests.log 2>&1; tail -2 $R/kernel_tests.log; t
timeout $(cap 200) python3 -m pytest -q tests/test_gpu.py -k "fused_greedy_coda or mixed_requests_staggered" > $R/gpu_tests.log 2>&1; tail -3 $R/gpu_tests.log; t
timeout $(cap 150) python3 benchmarks/kernels/coda_bench.py --sweep --hbm-tb-s $HBM --out $R/coda_sweep.json > $R/coda_sweep.log 2>&1; grep -E "plain|best" $R/coda_sweep.log; t
B="--shape ouro-1.4b --baseline none --input-len 128 --output-len 64 --repeats 3 --workload full threshold=0.5 --concurrency 1 2 8"
for side in off on; do
  [ $(left) -lt 60 ] && { echo "skip $side"; continue; }
  f=1; [ $side = off ] && f=0  # the switch: OURO_FUSED_CODA=1 on, 0 off
  OURO_FUSED_CODA=$f timeout $(( $(left) - 5 )) python3 -m ouro_backend.entrypoints.bench $B --label $side \
    --out $R/bench_$side.json > $R/bench_$side.log 2>&1; echo "$side $(t)"; grep -E "^(full|gate|thr)" $R/bench_$side.log | cut -c1-90 | head -8
done
