#!/usr/bin/env bash
# Session 2026-12-07 #6, call D (issues 30 and 29): prompt attention's packed q tiles (the working tree) against
# main c1ce666 (its attention.py in .calls/attention_head.py), from the repository root, carrying .device-bundle:
#  1. the GPU kernel tests of attention on the packed build;
#  2. the prompt-attention sweep, each case alone and padded to a mixed graph's 64 rows, on both builds, outputs
#     compared bitwise;
#  3. a fresh 2,048-token prompt profiled, A/B/A/B (wall now stops at the token's readback);
#  4. ouro-bench C64 128/64, 512 requests, full depth and the gate at 0.172, on both builds.
set -u
DL=${DL:-580}
source benchmarks/device_call.sh cD
t; cat $R/host.txt
NEW=$PWD
rm -rf /tmp/head_tree; mkdir -p /tmp/head_tree; cp -r ouro_backend /tmp/head_tree/; cp .calls/attention_head.py /tmp/head_tree/ouro_backend/kernels/attention.py
path() { case $1 in new*) echo $NEW;; head*) echo /tmp/head_tree:$NEW;; esac; }
PYTHONPATH=$NEW timeout -k 5 $(cap 150) python3 -c "from ouro_backend.entrypoints.bench import ensure_shape_checkpoint as e; print(e('ouro-1.4b'))" > $R/checkpoint.log 2>&1 &
CK=$!
PYTHONPATH=$NEW timeout -k 5 $(cap 90) python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "paged or attention or decode_launch or packed" > $R/kernel_tests.log 2>&1
echo "kernel tests: $(tail -1 $R/kernel_tests.log)"; t
for v in new head; do
  for g in 0 64; do
    PYTHONPATH=$(path $v) timeout -k 5 $(cap 60) python3 benchmarks/kernels/prefill_attn_sweep.py --cases 1x2048+0,16x128+0,4x512+512 --replays 10 --grid none --graph-rows $g --out $R/attn_${v}_g$g.json --save-outputs /tmp/attn_out_${v}_g$g.pt > $R/attn_${v}_g$g.log 2>&1
    echo "== $v graph-rows $g"; grep -E "default|sdpa" $R/attn_${v}_g$g.log | cut -c1-130; t
  done
done
python3 -c "
import torch; o={k: torch.load(f'/tmp/attn_out_{k}.pt') for k in ('new_g0','head_g0','new_g64','head_g64')}
for c in o['head_g0']: print('bitwise', c, {k: torch.equal(list(o[k].values())[list(o['head_g0']).index(c)], o['head_g0'][c]) for k in o})" 2>&1 | tail -4
wait $CK; tail -1 $R/checkpoint.log; t
prof() {  # label
  PYTHONPATH=$(path $1) timeout -k 5 $(cap 50) python3 benchmarks/round_profile.py --prompt-tokens 2048 --out $R/prompt_$1.json > $R/prompt_$1.log 2>&1
  python3 -c "
import json; d=json.load(open('$R/prompt_$1.json'))
print('$1', d['wall_ms'], d['kernel_us_by_kind'].get('attention'), d['all_tflops'], [(g['grid'], g['launches'], g['median_us']) for g in d['attention_launches']])" 2>&1 | tail -1; t
}
prof new1; prof head1; prof new2; prof head2
B="--shape ouro-1.4b --baseline none --input-len 128 --output-len 64 --concurrency 64 --num-requests 512 --repeats 1 --workload full threshold=0.172"
bench() {  # label
  PYTHONPATH=$(path $1) timeout -k 5 $(cap 75) python3 -m ouro_backend.entrypoints.bench $B --label $1 --out $R/bench_$1.json > $R/bench_$1.log 2>&1
  echo "$1 rc=$?"; grep -E "tok/s|depth" $R/bench_$1.log | tail -4 | cut -c1-200; t
}
bench new_c64; bench head_c64
[ "$(left)" -gt 80 ] && { bench new_c64b; bench head_c64b; }
t
