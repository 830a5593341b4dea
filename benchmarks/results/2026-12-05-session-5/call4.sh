#!/usr/bin/env bash
# Issue 30: the roofline (one-round graphs replayed alone, kernels alone) of main and of this tree in one
# call; the 2.6B shape at C1/C2/C16 full depth, main and this tree.
set -u
T0=$(date +%s); DL=${DL:-585}
export PYTHONUNBUFFERED=1 OURO_CACHE_DIR=/tmp/ourocache
R=$OUT/k; mkdir -p $R
t() { echo "t=$(( $(date +%s) - T0 ))"; }
left() { echo $(( DL - ($(date +%s) - T0) )); }
cap() { local a=$1 l; l=$(left); [ $a -gt $l ] && a=$l; echo $a; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/host.txt
HBM=4.8; grep -q H100 $R/host.txt && HBM=3.35
for i in 1 2; do for side in base after; do
  d=$PWD; [ $side = base ] && d=$PWD/.wt-base
  (cd $d && PYTHONPATH=$d timeout $(cap 75) python3 benchmarks/roofline.py --hbm-tb-s $HBM --label $side \
    --out $R/roofline_${side}_$i.json > $R/roofline_${side}_$i.log 2>&1; python3 -c "import json,sys; print('$side $i', json.load(open(sys.argv[1]))['decode_loop'])" $R/roofline_${side}_$i.json)
done; done; t
B="--shape ouro-2.6b --baseline none --input-len 128 --output-len 64 --repeats 3 --workload full --concurrency 1 2 16"
for side in base after; do
  d=$PWD; [ $side = base ] && d=$PWD/.wt-base
  (cd $d && PYTHONPATH=$d timeout $(cap 120) python3 -m ouro_backend.entrypoints.bench $B --label 26b_$side \
    --out $R/bench26_$side.json) 2>&1 | grep -E "^full" > $R/bench26_$side.log; echo $side; head -3 $R/bench26_$side.log | cut -c1-60; t
done
