#!/usr/bin/env bash
# Issue 30: down at 2 rows on dot_n32_k128_s4 (the 4-row entry) instead of cuBLAS: ouro-bench C2 full depth,
# main ($PWD) vs main + that table change (/tmp/down2), alternating twice.
set -u
T0=$(date +%s); DL=${DL:-400}
export PYTHONUNBUFFERED=1 OURO_CACHE_DIR=/tmp/ourocache
R=$OUT/e; mkdir -p $R
left() { echo $(( DL - ($(date +%s) - T0) )); }
nvidia-smi --query-gpu=name --format=csv,noheader > $R/host.txt; cat $R/host.txt
W=/tmp/down2; mkdir -p $W && cp -r ouro_backend benchmarks pyproject.toml $W/ && cp -r .wt-down2/* $W/
B="--shape ouro-1.4b --baseline none --input-len 128 --output-len 64 --repeats 3 --workload full threshold=0.5 --concurrency 2 16"
for i in 1 2; do for side in main down2; do
  [ $(left) -lt 45 ] && { echo "skip $side $i"; continue; }
  d=$PWD; [ $side = down2 ] && d=$W
  (cd $d && PYTHONPATH=$d timeout $(( $(left) - 5 )) python3 -m ouro_backend.entrypoints.bench $B --label ${side}_$i \
    --out $R/c2g_${side}_$i.json) > $R/c2g_${side}_$i.log 2>&1; echo "$side $i t=$(( $(date +%s) - T0 ))"; grep -E "^full" $R/c2g_${side}_$i.log | head -4 | cut -c1-70
done; done
cd $OUT && tar czf e.tgz e && rm -rf e
