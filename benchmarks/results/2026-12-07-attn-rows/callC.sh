#!/usr/bin/env bash
# Session 2026-12-06 #5, call C: decode attention's new launch rules (first tile one grain at 1 row; 2 splits at
# 5-8 rows; 2 stages from 5 rows; 2 warps from 17) against the old (.calls/old_attn.py): GPU attention tests,
# the loop at context 192, C8 / C1 / C64 steady state, then the loop at 1024 and C8 again, as time allows.
set -u
DL=${DL:-300}
source benchmarks/device_call.sh cC
export PYTHONPATH=$PWD
t; cat $R/host.txt
timeout -k 5 $(cap 80) python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "attention or paged or split or decode_launch" > $R/kernel_tests.log 2>&1; tail -1 $R/kernel_tests.log; grep -E "^FAILED" $R/kernel_tests.log | head; t
loop() {  # side context
  [ $(left) -lt 50 ] && { echo "skip loop $1 $2"; return; }
  local pre=""; [ $1 = old ] && pre=".calls/old_attn.py"
  timeout -k 5 $(cap 40) python3 $pre benchmarks/kernels/loop_bench.py variants --rows 1,5,8,16,32,64 --context $2 --replays 30 --names default --out $R/loop_$1_$2.json > $R/loop_$1_$2.log 2>&1
  echo "$1 ctx=$2 $(grep -E '^M=' $R/loop_$1_$2.log | awk '{print $1$2, $4}' | tr '\n' ' ')"; t
}
B="--shape ouro-1.4b --baseline none --input-len 128 --output-len 64 --workload full"
bench() {  # label side args...
  local l=$1 s=$2; shift 2
  [ $(left) -lt 45 ] && { echo "skip $l"; return; }
  local pre="-m"; [ $s = old ] && pre=".calls/old_attn.py -m"
  timeout -k 5 $(cap 60) python3 $pre ouro_backend.entrypoints.bench $B "$@" --label $l --out $R/$l.json > $R/$l.log 2>&1
  echo "$l $(t) $(grep -E '^full' $R/$l.log | head -1 | cut -c1-70)"
}
loop new 192; loop old 192
bench c8_new new --repeats 2 --concurrency 8; bench c8_old old --repeats 2 --concurrency 8
bench c1_new new --repeats 2 --concurrency 1; bench c1_old old --repeats 2 --concurrency 1
bench c64_new new --repeats 1 --concurrency 64 --num-requests 512; bench c64_old old --repeats 1 --concurrency 64 --num-requests 512
loop new 1024; loop old 1024
bench c8_old_b old --repeats 2 --concurrency 8; bench c8_new_b new --repeats 2 --concurrency 8
