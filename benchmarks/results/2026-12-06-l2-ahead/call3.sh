#!/usr/bin/env bash
# Session 2026-12-06 #3, call 3: the GPU tests of the table's configs; decode attention's split-KV, the
# sandwich norm's warps and the L2 share in the loop; the decode table at 5-8 rows (8fd6942) against the
# table before (this tree with .calls/table.patch reversed, in /tmp/base) at C8, full depth, A/B/A/B.
set -u
DL=${DL:-250}
source benchmarks/device_call.sh s3c2
export PYTHONPATH=$PWD
t; cat $R/host.txt
rm -rf /tmp/base && mkdir /tmp/base && cp -r ouro_backend benchmarks client /tmp/base/ && (cd /tmp/base && patch -R -p1 < $OLDPWD/.calls/table.patch) > $R/base_patch.log 2>&1; tail -1 $R/base_patch.log
timeout $(cap 45) python3 -m pytest -q tests/test_kernels.py -k "table_configs" > $R/kernel_tests.log 2>&1; tail -1 $R/kernel_tests.log; t
N=attn_s1_n64,attn_s2_n64,attn_s4_n64,attn_s4_n32,attn_s8_n32,attn_s16_n16,norm_warps_2,l2_gate_up_0
timeout $(cap 140) python3 benchmarks/kernels/loop_bench.py variants --rows 1,2,4,8 --replays 30 --names $N --out $R/variants.json > $R/variants.log 2>&1; cut -c1-100 $R/variants.log | grep M=; t
B="--shape ouro-1.4b --baseline none --input-len 128 --output-len 64 --repeats 2 --workload full --concurrency 8"
for side in base new base2 new2; do
  [ $(left) -lt 35 ] && { echo "skip $side"; continue; }
  if [[ $side == base* ]]; then root=/tmp/base; else root=$PWD; fi
  (cd $root && PYTHONPATH=$root timeout $(cap 45) python3 -m ouro_backend.entrypoints.bench $B --label $side --out $R/bench_$side.json) > $R/bench_$side.log 2>&1; echo "$side $(t)"; grep -E "^(full|thr)" $R/bench_$side.log | cut -c1-100 | head -2
done
