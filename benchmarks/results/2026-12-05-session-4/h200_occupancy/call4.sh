#!/usr/bin/env bash
# (run as .calls/s5/*.sh on the device; the paths here point to this folder's copies)
# Issue 30: one-row projection configs with more programs (ncu: 12-32% achieved occupancy), tuned in the
# loop, then C1 full depth with the table (base) and with the tune's choices (after), same call.
set -u
T0=$(date +%s)
export PYTHONUNBUFFERED=1 OURO_CACHE_DIR=/tmp/ourocache PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/host.txt
timeout 170 python3 benchmarks/kernels/loop_bench.py tune --rows 1 --top 8 --sweep benchmarks/results/2026-12-05-session-4/h200_occupancy/occ_candidates.json \
  --out $OUT/occ_tune.json > $OUT/occ_tune.log 2>&1; grep "M=" $OUT/occ_tune.log; echo "t=$(( $(date +%s) - T0 ))"
B="--shape ouro-1.4b --baseline none --input-len 128 --output-len 64 --concurrency 1 --repeats 3 --workload full"
timeout 60 python3 -m ouro_backend.entrypoints.bench $B --label c1_table --out $OUT/c1_table.json 2>&1 | grep -E "rep [0-9]|^full"
[ -f $OUT/occ_tune.json ] && timeout 60 python3 benchmarks/kernels/bench_with_tune.py $OUT/occ_tune.json $B --label c1_tuned --out $OUT/c1_tuned.json 2>&1 | grep -E "override|rep [0-9]|^full"
echo "t=$(( $(date +%s) - T0 ))"
