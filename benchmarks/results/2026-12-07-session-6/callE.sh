#!/usr/bin/env bash
# Session 2026-12-07 #6, call E (issue 30): the packed prompt grid (the working tree) against main c1ce666 (its
# attention.py in .calls/attention_head.py) on prompt-heavy workloads, from the repository root, carrying
# .device-bundle:
#  1. ouro-bench full depth, 2,048 in / 64 out at C16 (64 requests) and 1,024 in / 128 out at C128 (256
#     requests), new / head / new / head;
#  2. the prompt-attention configs on the packed grid, as a mixed graph launches them (64 rows).
set -u
DL=${DL:-420}
source benchmarks/device_call.sh cE
t; cat $R/host.txt
NEW=$PWD
rm -rf /tmp/head_tree; mkdir -p /tmp/head_tree; cp -r ouro_backend /tmp/head_tree/; cp .calls/attention_head.py /tmp/head_tree/ouro_backend/kernels/attention.py
path() { case $1 in new*) echo $NEW;; head*) echo /tmp/head_tree:$NEW;; esac; }
PYTHONPATH=$NEW timeout -k 5 $(cap 150) python3 -c "from ouro_backend.entrypoints.bench import ensure_shape_checkpoint as e; print(e('ouro-1.4b'))" > $R/checkpoint.log 2>&1; tail -1 $R/checkpoint.log; t
bench() {  # label args...
  local l=$1; shift
  PYTHONPATH=$(path $l) timeout -k 5 $(cap 70) python3 -m ouro_backend.entrypoints.bench --shape ouro-1.4b --baseline none --repeats 1 --workload full "$@" --label $l --out $R/bench_$l.json > $R/bench_$l.log 2>&1
  echo "$l rc=$?"; grep -E "^full" $R/bench_$l.log | head -1 | cut -c1-160; t
}
for v in new head new_b head_b; do
  bench ${v}_2k --input-len 2048 --output-len 64 --concurrency 16 --num-requests 64
  bench ${v}_1k --input-len 1024 --output-len 128 --concurrency 128 --num-requests 256
done
PYTHONPATH=$NEW timeout -k 5 $(cap 60) python3 benchmarks/kernels/prefill_attn_sweep.py --cases 1x2048+0,16x128+0,4x512+512 --replays 10 --graph-rows 64 --grid m64_n64_w4_st2,m128_n64_w8_st2,m128_n64_w8_st3,m128_n128_w8_st3 --out $R/attn_cfg.json > $R/attn_cfg.log 2>&1
grep -vE "^\[" $R/attn_cfg.log | cut -c1-130; t
