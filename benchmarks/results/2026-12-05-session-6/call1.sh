#!/usr/bin/env bash
# Issue 30: the fused decode attention warms L2 with the first MB of each layer's gate/up weight.
# loop_bench warm sweep (context 192 and 1024), then ouro-bench C1/C16 full depth, warm off vs the sweep's
# table, alternating twice (same tree: OURO_WARM_MB=0 is main's behaviour).
set -u
T0=$(date +%s); DL=${DL:-570}
export PYTHONUNBUFFERED=1 OURO_CACHE_DIR=/tmp/ourocache
R=$OUT/w; mkdir -p $R
t() { echo "t=$(( $(date +%s) - T0 ))"; }
left() { echo $(( DL - ($(date +%s) - T0) )); }
cap() { local a=$1 l; l=$(left); [ $a -gt $l ] && a=$l; echo $a; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/host.txt; cat $R/host.txt
PYTHONPATH=$PWD timeout 120 python3 -m pytest -q tests/test_kernels.py -k "rope_kv_attention or warm" -p no:cacheprovider > $R/gpu_tests.log 2>&1; echo "rc=$?" >> $R/gpu_tests.log
tail -2 $R/gpu_tests.log; t
PYTHONPATH=$PWD timeout $(cap 150) python3 benchmarks/kernels/loop_bench.py warm --context 192 --rows 1,2,4,8,16 \
  --warm-mb 0,8,16,24,32,0,16,40 --out $R/warm_ctx192.json > $R/warm_ctx192.log 2>&1; tail -3 $R/warm_ctx192.log; t
TABLE=$(python3 - $R/warm_ctx192.json <<'PY'
import json, sys, statistics as st
d = json.load(open(sys.argv[1]))["loops_ms"]
rows = sorted({int(m) for v in d.values() for m in v})
out = []
for m in rows:
    best = min(d, key=lambda mb: st.mean(d[mb][str(m)]))
    base = st.mean(d["0"][str(m)])
    gain = 1 - st.mean(d[best][str(m)]) / base
    out.append(f"{m}:{best if gain > 0.01 else 0}")
print(",".join(out))
PY
)
echo "TABLE=$TABLE" | tee $R/table.txt
PYTHONPATH=$PWD timeout $(cap 60) python3 benchmarks/kernels/loop_bench.py warm --context 1024 --rows 1,4,16 \
  --warm-mb 0,16,32,0 --replays 30 --out $R/warm_ctx1024.json > $R/warm_ctx1024.log 2>&1; tail -2 $R/warm_ctx1024.log; t
B="--shape ouro-1.4b --baseline none --input-len 128 --output-len 64 --repeats 3 --workload full --concurrency 1 16"
for i in 1 2; do for side in off on; do
  w=0; [ $side = on ] && w=$TABLE
  OURO_WARM_MB=$w PYTHONPATH=$PWD timeout $(cap 80) python3 -m ouro_backend.entrypoints.bench $B --label ${side}_$i \
    --out $R/bench_${side}_$i.json > $R/bench_${side}_$i.log 2>&1; echo "$side $i"; grep -E "^full" $R/bench_${side}_$i.log | cut -c1-70; t
done; done
HBM=4.8; grep -q H100 $R/host.txt && HBM=3.35
OURO_WARM_MB=$TABLE PYTHONPATH=$PWD timeout $(cap 75) python3 benchmarks/roofline.py --hbm-tb-s $HBM --label warm --out $R/roofline_warm.json > $R/roofline_warm.log 2>&1; tail -2 $R/roofline_warm.log; t
cd $OUT && tar czf w.tgz w && rm -rf w
