#!/usr/bin/env bash
# Session 2026-12-07 #6, call H, prepared and not run (no device time left; issue 30): inside a running engine, do prompt attention launches take what the sweep
# says? `round_profile.py --prompt-tokens 2048 --busy 16`: 16 fresh 2,048-token prompts at once, a window of 12
# steps timed by the launch timer (as ouro-bench), then 12 more under torch.profiler; new (the packed grid) / head
# (main c1ce666's attention.py: `mkdir -p .calls && git show c1ce666:ouro_backend/kernels/attention.py >
# .calls/attention_head.py`), A/B/A/B; then prompt attention with 32-key tiles (3 blocks per SM) on the sweep.
# Carrying .device-bundle.
set -u
DL=${DL:-220}
source benchmarks/device_call.sh cH
t; cat $R/host.txt
NEW=$PWD
rm -rf /tmp/head_tree; mkdir -p /tmp/head_tree; cp -r ouro_backend /tmp/head_tree/; cp .calls/attention_head.py /tmp/head_tree/ouro_backend/kernels/attention.py
path() { case $1 in new*) echo $NEW;; head*) echo /tmp/head_tree:$NEW;; esac; }
PYTHONPATH=$NEW timeout -k 5 $(cap 150) python3 -c "from ouro_backend.entrypoints.bench import ensure_shape_checkpoint as e; print(e('ouro-1.4b'))" > $R/checkpoint.log 2>&1; tail -1 $R/checkpoint.log; t
for v in new1 head1 new2 head2; do
  PYTHONPATH=$(path $v) timeout -k 5 $(cap 45) python3 benchmarks/round_profile.py --prompt-tokens 2048 --busy 16 --steps 12 --out $R/busy_$v.json > $R/busy_$v.log 2>&1
  python3 -c "
import json; d=json.load(open('$R/busy_$v.json'))
for w in ('plain', 'profiled'):
    print('$v', w, 'busy', d[w + '_busy_ms'], {k: (g['launches'], round(g['ms_per_round'], 3)) for k, g in d[w + '_by_kind'].items()})
print('$v', d['kernel_us_by_kind'].get('attention'), [(g['grid'], g['launches'], g['median_us']) for g in d['attention_launches']])" 2>&1 | tail -3; t
done
# 32-key tiles: 146 registers and 49 KB of shared memory a block (aot_check, sm_90), so 3 blocks per SM instead
# of the default's 2 (189 registers, 82 KB)
PYTHONPATH=$NEW timeout -k 5 $(cap 40) python3 benchmarks/kernels/prefill_attn_sweep.py --cases 1x2048+0,16x128+0,4x512+512 --replays 10 --graph-rows 64 --grid m64_n32_w4_st3,m64_n32_w4_st2 --out $R/attn_n32.json > $R/attn_n32.log 2>&1
grep -vE "^\[" $R/attn_n32.log | cut -c1-130; t
