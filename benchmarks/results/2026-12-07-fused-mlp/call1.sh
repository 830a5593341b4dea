#!/usr/bin/env bash
# Session 2026-12-07 #2, call 1 (main 357dd38): the fused decode MLP (kernels/decode_mlp.py) on the GPU: the MLP
# alone over configs (mlp_bench fused), the loop at one row against the two projections, C1 full depth with
# the loop's best config against OURO_FUSED_MLP=0, then GPU kernel tests and one GPU oracle test.
set -u
DL=${DL:-368}
source benchmarks/device_call.sh c1
export PYTHONPATH=$PWD
t; cat $R/host.txt
timeout -k 5 $(cap 95) python3 benchmarks/kernels/mlp_bench.py --sections fused --fused-rows 1,2 --hbm-tb-s $HBM --out $R/mlp_fused.json > $R/mlp_fused.log 2>&1
python3 - $R/mlp_fused.log <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
for M in (1, 2):
    r = sorted((x for x in rows if x["M"] == M), key=lambda x: x["us"])
    print(M, " ".join(f"{x['cfg'].replace('two projections','PAIR')}={x['us']:.2f}" for x in r[:8]), "| pair", [round(x["us"], 2) for x in r if x["cfg"] == "two projections"])
PY
t
NAMES=two_projection_mlp,mlp_c16_k64_h64_w4,mlp_c16_k128_h128_w8,mlp_c8_k128_h128_w4,mlp_c8_k256_h128_w4,mlp_c32_k128_h128_w8
timeout -k 5 $(cap 70) python3 benchmarks/kernels/loop_bench.py variants --rows 1 --context 192 --replays 30 --names $NAMES --out $R/loop.json > $R/loop.log 2>&1
grep -E "^M=" $R/loop.log | awk '{print $1$2, $3, $4}'; t
BEST=$(grep -E "^M= +1 (mlp_|default)" $R/loop.log | sort -k4 -n | head -1 | awk "{print \$3}")
[ "$BEST" = default ] && BEST=mlp_c16_k128_h128_w4
echo "best at one row: $BEST"
B="--shape ouro-1.4b --baseline none --input-len 128 --output-len 64 --workload full --repeats 2 --concurrency 1"
c1() {  # label config
  [ $(left) -lt 45 ] && { echo "skip $1"; return; }
  timeout -k 5 $(cap 50) python3 .calls/with_mlp.py $2 -m ouro_backend.entrypoints.bench $B --label $1 --out $R/$1.json > $R/$1.log 2>&1
  echo "$1 $(grep -E 'rep [01]:' $R/$1.log | sed 's/.*rep/rep/' | tr '\n' ' ') $(t)"
}
[ -n "$BEST" ] && { c1 c1_off_a off; c1 c1_fused_a $BEST; }
timeout -k 5 $(cap 60) python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "fused_mlp or mlp_routes" > $R/kernel_tests.log 2>&1; tail -1 $R/kernel_tests.log; grep -E "^FAILED" $R/kernel_tests.log | head; t
timeout -k 5 $(cap 60) python3 -m pytest -v -p no:cacheprovider tests/test_gpu.py -k "greedy_equals_oracle and not cublas and 4-0.5-True-shared" > $R/gpu_tests.log 2>&1
echo "rc=$?" >> $R/gpu_tests.log; grep -E "PASSED|FAILED|ERROR|passed|failed|rc=" $R/gpu_tests.log | tail -4; t
