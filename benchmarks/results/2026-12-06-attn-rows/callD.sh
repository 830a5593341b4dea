#!/usr/bin/env bash
# Owed, not run (for an H200): the 2.8% of C1 the H200 lost on main dba2b66 against 231 tok/s before the L2
# prefetch / 5-8-row table / split changes. OURO_L2_AHEAD=0/1 alternating at C1, then the decode rounds
# (roofline.py) with each. Run from the repository root: bash benchmarks/results/2026-12-06-attn-rows/callD.sh
set -u
DL=${DL:-330}
source benchmarks/device_call.sh cD
export PYTHONPATH=$PWD
t; cat $R/host.txt
B="--shape ouro-1.4b --baseline none --input-len 128 --output-len 64 --repeats 2 --workload full --concurrency 1"
for l2 in 1 0 0 1; do
  [ $(left) -lt 40 ] && break
  OURO_L2_AHEAD=$l2 timeout -k 5 $(cap 45) python3 -m ouro_backend.entrypoints.bench $B --label c1_l2_$l2 --out $R/c1_l2_${l2}_$(date +%s).json > $R/c1_l2_$l2.$(date +%s).log 2>&1
  echo "l2=$l2 $(t)"
done
grep -h -E "rep [01]:" $R/c1_l2_*.log
for l2 in 1 0; do
  [ $(left) -lt 60 ] && break
  OURO_L2_AHEAD=$l2 timeout -k 5 $(cap 70) python3 benchmarks/roofline.py --hbm-tb-s $HBM --label l2_$l2 --out $R/roofline_l2_$l2.json > $R/roofline_l2_$l2.log 2>&1
  echo "l2=$l2 $(grep -m1 decode_loop $R/roofline_l2_$l2.log)"; t
done
