#!/usr/bin/env bash
# Issue 30: defer_sum (one reduction after the K loop, every row) and the fma path at 2-8 rows, tuned in the
# decode loop; then ouro-bench C1/C4/C8 full depth with main's table (base tree) and with the tune's choices
# (this tree + benchmarks/kernels/bench_with_tune.py), same call; then the projection kernels' GPU tests.
set -u
T0=$(date +%s); DL=${DL:-580}
export PYTHONUNBUFFERED=1 OURO_CACHE_DIR=/tmp/ourocache
R=$OUT/k; mkdir -p $R
t() { echo "t=$(( $(date +%s) - T0 ))"; }
left() { echo $(( DL - ($(date +%s) - T0) )); }
cap() { local a=$1 l; l=$(left); [ $a -gt $l ] && a=$l; echo $a; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/host.txt
PYTHONPATH=$PWD timeout 260 python3 benchmarks/kernels/loop_bench.py tune --rows 1,2,4,8 --top 10 \
  --sweep .calls/s6/ds_rows.json --out $R/tune.json > $R/tune.log 2>&1; echo "rc=$?" >> $R/tune.log
grep -E "^M=|rc=" $R/tune.log; t
B="--shape ouro-1.4b --baseline none --input-len 128 --output-len 64 --repeats 3 --workload full"
(cd .wt-base && PYTHONPATH=$PWD timeout $(cap 110) python3 -m ouro_backend.entrypoints.bench $B --concurrency 1 4 8 \
  --label base --out $R/bench_base.json) 2>&1 | grep -E "rep [0-9]|^full|tok/s" > $R/bench_base.log; tail -6 $R/bench_base.log; t
[ -f $R/tune.json ] && PYTHONPATH=$PWD timeout $(cap 110) python3 benchmarks/kernels/bench_with_tune.py $R/tune.json $B --concurrency 1 4 8 \
  --label tuned --out $R/bench_tuned.json 2>&1 | grep -E "override|rep [0-9]|^full|tok/s" > $R/bench_tuned.log; tail -6 $R/bench_tuned.log; t
PYTHONPATH=$PWD timeout $(cap 120) python3 -m pytest -q tests/test_kernels.py -k "linear" -p no:cacheprovider > $R/gpu_kernel_tests.log 2>&1; echo "rc=$?" >> $R/gpu_kernel_tests.log
tail -3 $R/gpu_kernel_tests.log; t
