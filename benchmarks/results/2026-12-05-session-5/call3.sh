#!/usr/bin/env bash
# Issue 30: confirm the table's new entries end to end (qkv defer_sum at 2 rows; qkv split 4 and o n16 st6 at
# 16 rows): ouro-bench C2 and C16 full depth, main (.wt-base) and this tree alternating twice; the kernels'
# GPU tests; the roofline of this tree.
set -u
T0=$(date +%s); DL=${DL:-585}
export PYTHONUNBUFFERED=1 OURO_CACHE_DIR=/tmp/ourocache
R=$OUT/k; mkdir -p $R
t() { echo "t=$(( $(date +%s) - T0 ))"; }
left() { echo $(( DL - ($(date +%s) - T0) )); }
cap() { local a=$1 l; l=$(left); [ $a -gt $l ] && a=$l; echo $a; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/host.txt
HBM=4.8; grep -q H100 $R/host.txt && HBM=3.35
PYTHONPATH=$PWD timeout 100 python3 -m pytest -q tests/test_kernels.py -k "linear" -p no:cacheprovider > $R/gpu_kernel_tests.log 2>&1; echo "rc=$?" >> $R/gpu_kernel_tests.log
tail -2 $R/gpu_kernel_tests.log; t
B="--shape ouro-1.4b --baseline none --input-len 128 --output-len 64 --repeats 3 --workload full --concurrency 2 16"
for i in 1 2; do for side in base after; do
  d=$PWD; [ $side = base ] && d=$PWD/.wt-base
  (cd $d && PYTHONPATH=$d timeout $(cap 75) python3 -m ouro_backend.entrypoints.bench $B --label ${side}_$i \
    --out $R/bench_${side}_$i.json) 2>&1 | grep -E "^full" > $R/bench_${side}_$i.log; echo "$side $i"; head -2 $R/bench_${side}_$i.log | cut -c1-60; t
done; done
PYTHONPATH=$PWD timeout $(cap 75) python3 benchmarks/roofline.py --hbm-tb-s $HBM --label after --out $R/roofline_after.json > $R/roofline_after.log 2>&1; tail -2 $R/roofline_after.log; t
