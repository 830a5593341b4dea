#!/usr/bin/env bash
# Session 2026-12-07 #2, call 2: the fused decode MLP with down stored transposed (call 1: with down's [H, I]
# rows, each program's 32-byte column slices made the loop 2x slower). mlp_bench at one row (both layouts),
# the loop at one row (down_t_* variants against the two projections), C1 full depth with down transposed.
set -u
DL=${DL:-330}
source benchmarks/device_call.sh c2
export PYTHONPATH=$PWD
t; cat $R/host.txt
timeout -k 5 $(cap 80) python3 benchmarks/kernels/mlp_bench.py --sections fused --fused-rows 1 --hbm-tb-s $HBM --out $R/mlp_fused.json > $R/mlp_fused.log 2>&1
python3 - $R/mlp_fused.log <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
r = sorted(rows, key=lambda x: x["us"])
print(" ".join(f"{x['cfg'].replace('two projections','PAIR')}={x['us']:.2f}" for x in r[:10]), "| pair", [round(x["us"], 2) for x in r if x["cfg"] == "two projections"])
PY
t
NAMES=two_projection_mlp,down_t_mlp_c16_k128_h128_w4,down_t_mlp_c16_k64_h64_w4,down_t_mlp_c8_k128_h128_w4,down_t_mlp_c16_k128_h128_w8,down_t_mlp_c4_k256_h256_w4,down_t_mlp_c32_k128_h128_w8
timeout -k 5 $(cap 70) python3 benchmarks/kernels/loop_bench.py variants --rows 1 --context 192 --replays 30 --names $NAMES --out $R/loop.json > $R/loop.log 2>&1
grep -E "^M=" $R/loop.log | awk '{print $1$2, $3, $4}'; t
BEST=$(grep -E "^M= +1 down_t_" $R/loop.log | sort -k4 -n | head -1 | awk "{print \$3}" | sed 's/^down_t_//')
echo "best at one row: $BEST"
B="--shape ouro-1.4b --baseline none --input-len 128 --output-len 64 --workload full --repeats 2 --concurrency 1"
c1() {  # label config [--down-t]
  [ $(left) -lt 45 ] && { echo "skip $1"; return; }
  local l=$1; shift
  timeout -k 5 $(cap 50) python3 .calls/with_mlp.py "$@" -m ouro_backend.entrypoints.bench $B --label $l --out $R/$l.json > $R/$l.log 2>&1
  echo "$l $(grep -E 'rep [01]:' $R/$l.log | sed 's/.*rep/rep/' | tr '\n' ' ') $(t)"
}
[ -n "$BEST" ] && { c1 c1_off off; c1 c1_fused_t $BEST --down-t; c1 c1_fused_t_b $BEST --down-t; c1 c1_off_b off; }
