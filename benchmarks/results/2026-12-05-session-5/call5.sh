#!/usr/bin/env bash
# Issue 30: do the 16-row entries add to C16, or was it the 2-row entry in the run's smaller rounds? C16 full
# depth, this tree (.wt-m2only: only the 2-row entry) and this tree with both, alternating twice.
set -u
export PYTHONUNBUFFERED=1 OURO_CACHE_DIR=/tmp/ourocache
R=$OUT/k; mkdir -p $R; T0=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader > $R/host.txt
B="--shape ouro-1.4b --baseline none --input-len 128 --output-len 64 --repeats 3 --workload full --concurrency 16"
for i in 1 2; do for side in m2only both; do
  d=$PWD; [ $side = m2only ] && d=$PWD/.wt-m2only
  (cd $d && PYTHONPATH=$d timeout 60 python3 -m ouro_backend.entrypoints.bench $B --label ${side}_$i --out $R/c16_${side}_$i.json) 2>&1 | grep -E "^full" | head -1 | cut -c1-40
  echo "$side $i t=$(( $(date +%s) - T0 ))"
done; done
