#!/usr/bin/env bash
# Issue 30: (1) tensor-core tiles at 2-16 rows tuned in the decode loop (on top of this tree's table: qkv
# defer_sum at 1-2 rows); (2) ouro-bench C1-C16 full depth, main (.wt-base) vs this tree + the tune's
# choices, same call; (3) roofline main vs this tree.
set -u
T0=$(date +%s); DL=${DL:-585}
export PYTHONUNBUFFERED=1 OURO_CACHE_DIR=/tmp/ourocache
R=$OUT/k; mkdir -p $R
t() { echo "t=$(( $(date +%s) - T0 ))"; }
left() { echo $(( DL - ($(date +%s) - T0) )); }
cap() { local a=$1 l; l=$(left); [ $a -gt $l ] && a=$l; echo $a; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/host.txt
HBM=4.8; grep -q H100 $R/host.txt && HBM=3.35
PYTHONPATH=$PWD timeout 240 python3 benchmarks/kernels/loop_bench.py tune --rows 2,4,8,16 --top 8 \
  --sweep .calls/s6/dot_rows.json --out $R/tune.json > $R/tune.log 2>&1; echo "rc=$?" >> $R/tune.log
grep -E "^M=|rc=" $R/tune.log | cut -c1-200; t
B="--shape ouro-1.4b --baseline none --input-len 128 --output-len 64 --repeats 3 --workload full"
(cd .wt-base && PYTHONPATH=$PWD timeout $(cap 100) python3 -m ouro_backend.entrypoints.bench $B --concurrency 1 2 4 8 16 \
  --label base --out $R/bench_base.json) 2>&1 | grep -E "^full" > $R/bench_base.log; cat $R/bench_base.log | cut -c1-60; t
[ -f $R/tune.json ] && PYTHONPATH=$PWD timeout $(cap 100) python3 benchmarks/kernels/bench_with_tune.py $R/tune.json $B --concurrency 1 2 4 8 16 \
  --label tuned --out $R/bench_tuned.json 2>&1 | grep -E "^full" > $R/bench_tuned.log; cat $R/bench_tuned.log | cut -c1-60; t
for side in base after; do
  d=$PWD; [ $side = base ] && d=$PWD/.wt-base
  (cd $d && PYTHONPATH=$d timeout $(cap 75) python3 benchmarks/roofline.py --hbm-tb-s $HBM --label $side --out $R/roofline_$side.json > $R/roofline_$side.log 2>&1; tail -2 $R/roofline_$side.log)
done; t
