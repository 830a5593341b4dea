#!/usr/bin/env bash
# Session 2026-12-06 #5, call A: decode attention launch configs at 8-64 rows (alone, then in the loop);
# the owed call 3 of the last session: C1 A/B/A/B grain vs 32-key tiles; one-row loop at 3 contexts.
set -u
DL=${DL:-575}
source benchmarks/device_call.sh cA
export PYTHONPATH=$PWD
t; cat $R/host.txt
timeout -k 5 $(cap 300) python3 benchmarks/kernels/attn_sweep.py --rows 8,16,32,64 --contexts 192,1024 --loop-context 192 --hbm-tb-s $HBM --out $R/attn_sweep.json > $R/attn_sweep.log 2>&1; grep -E "^rows|^loop" $R/attn_sweep.log | cut -c1-200; tail -3 $R/attn_sweep.log; t
B="--shape ouro-1.4b --baseline none --input-len 128 --output-len 64 --repeats 2 --workload full --concurrency 1"
bench() {  # label [script]
  [ $(left) -lt 30 ] && { echo "skip $1"; return; }
  timeout -k 5 $(cap 45) python3 ${2:--m ouro_backend.entrypoints.bench} $B --label $1 --out $R/$1.json > $R/$1.log 2>&1
  echo "$1 $(t)"; grep -E "^full" $R/$1.log | cut -c1-60 | head -1
}
bench c1_g32; bench c1_n32 .calls/bench_n32.py; bench c1_n32_b .calls/bench_n32.py; bench c1_g32_b
for c in 256 4096; do
  [ $(left) -lt 40 ] && break
  timeout -k 5 $(cap 40) python3 benchmarks/kernels/loop_bench.py variants --rows 1 --context $c --replays 30 --names attn_s8_n32,attn_s8_n64 --out $R/ctx$c.json > $R/ctx$c.log 2>&1; echo ctx=$c; cut -c1-100 $R/ctx$c.log | grep M=; t
done
