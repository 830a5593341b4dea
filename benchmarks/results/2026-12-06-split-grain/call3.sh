#!/usr/bin/env bash
# Session 2026-12-06 #4, call 3 (main dba2b66 + split grain + 4 splits at 3-4 rows, uncommitted): GPU attention
# tests; one-row decode attention at contexts 256/1024/4096: default (64-key tiles, 32-key splits) against 32-key
# tiles (dba2b66) and 64-key splits (before 8cb2c64); ouro-bench C1 default against 32-key tiles, A/B/A/B.
set -u
DL=${DL:-300}
source benchmarks/device_call.sh c3
export PYTHONPATH=$PWD
t; cat $R/host.txt
timeout $(cap 60) python3 -m pytest -q tests/test_kernels.py -k "engines_config or rope_kv_attention or split or paged" > $R/kernel_tests.log 2>&1; tail -1 $R/kernel_tests.log; t
for c in 256 1024 4096; do
  timeout $(cap 30) python3 benchmarks/kernels/loop_bench.py variants --rows 1 --context $c --replays 30 --names attn_s8_n32,attn_s8_n64 --out $R/ctx$c.json > $R/ctx$c.log 2>&1; echo ctx=$c; cut -c1-100 $R/ctx$c.log | grep M=; t
done
B="--shape ouro-1.4b --baseline none --input-len 128 --output-len 64 --repeats 2 --workload full --concurrency 1"
bench() {  # label [script]
  [ $(left) -lt 25 ] && { echo "skip $1"; return; }
  timeout $(cap 40) python3 ${2:--m ouro_backend.entrypoints.bench} $B --label $1 --out $R/$1.json > $R/$1.log 2>&1
  echo "$1 $(t)"; grep -E "^full" $R/$1.log | cut -c1-60 | head -1
}
bench c1_g32; bench c1_n32 .calls/bench_n32.py; bench c1_n32_b .calls/bench_n32.py; bench c1_g32_b
