#!/usr/bin/env bash
# Issue 30: the fused coda with its measured table (1, 2 rows CUDA cores; 3-64 tensor cores): the real-LM-head
# test, the microbench at the table, then ouro-bench off/on, C1 C4 C16 C64, full depth and gate 0.5.
set -u
source benchmarks/device_call.sh c2
export PYTHONPATH=$PWD
t
timeout $(cap 100) python3 -m pytest -q tests/test_kernels.py -k "coda" > $R/kernel_tests.log 2>&1; tail -1 $R/kernel_tests.log; t
timeout $(cap 60) python3 benchmarks/kernels/coda_bench.py --rows 1,2,4,8,16,64 --hbm-tb-s $HBM --out $R/coda_table.json > $R/coda_table.log 2>&1; grep -E "plain|->" $R/coda_table.log | cut -c1-160; t
B="--shape ouro-1.4b --baseline none --input-len 128 --output-len 64 --repeats 2 --workload full threshold=0.5 --concurrency 1 4 16 64"
for side in on off; do
  [ $(left) -lt 60 ] && { echo "skip $side"; continue; }
  f=1; [ $side = off ] && f=0  # the switch: OURO_FUSED_CODA=1 on, 0 off
  OURO_FUSED_CODA=$f timeout $(( $(left) - 5 )) python3 -m ouro_backend.entrypoints.bench $B --label $side \
    --out $R/bench_$side.json > $R/bench_$side.log 2>&1; echo "$side $(t)"; grep -E "^(full|thr)" $R/bench_$side.log | cut -c1-100 | head -8
done
