#!/usr/bin/env bash
# Session 2026-12-07 #7, call B (H200, main b3e316b): the 2.6B shape at C1 and C64 steady state (issue 30); then
# session 6's call H, which did not run then (`../2026-12-07-session-6/callH_not_run.sh`): inside a running
# engine, do the prompt attention launches take what the sweep says? `round_profile.py --prompt-tokens 2048
# --busy 16`, new (main) / head (main c1ce666's attention.py in .calls/attention_head.py: `mkdir -p .calls &&
# git show c1ce666:ouro_backend/kernels/attention.py > .calls/attention_head.py`), A/B/A/B; then 32-key tiles
# on the sweep. From the repository root, carrying .device-bundle.
set -u
DL=${DL:-430}
source benchmarks/device_call.sh cB
t; cat $R/host.txt
NEW=$PWD
rm -rf /tmp/head_tree; mkdir -p /tmp/head_tree; cp -r ouro_backend /tmp/head_tree/; cp .calls/attention_head.py /tmp/head_tree/ouro_backend/kernels/attention.py
path() { case $1 in new*) echo $NEW;; head*) echo /tmp/head_tree:$NEW;; esac; }
PYTHONPATH=$NEW timeout -k 5 $(cap 150) python3 -c "
from ouro_backend.entrypoints.bench import ensure_shape_checkpoint as e
print(e('ouro-1.4b')); print(e('ouro-2.6b'))" > $R/checkpoint.log 2>&1; tail -2 $R/checkpoint.log; t
echo "+ python3 -m ouro_backend.entrypoints.bench --shape ouro-2.6b --baseline none --input-len 128 --output-len 64 --concurrency 1 64 --waves 8 --repeats 1 --workload full" > $R/b26.log
PYTHONPATH=$NEW timeout -k 5 $(cap 130) python3 -m ouro_backend.entrypoints.bench --shape ouro-2.6b --baseline none --input-len 128 --output-len 64 \
  --concurrency 1 64 --waves 8 --repeats 1 --workload full --out $R/b26.json >> $R/b26.log 2>&1 || echo "b26 rc=$?" >> $R/errors.txt
grep -A6 "^ *in [0-9]* / out" $R/b26.log | cut -c1-175; t
for v in new1 head1 new2 head2; do
  PYTHONPATH=$(path $v) timeout -k 5 $(cap 50) python3 benchmarks/round_profile.py --prompt-tokens 2048 --busy 16 --steps 12 --out $R/busy_$v.json > $R/busy_$v.log 2>&1
  python3 -c "
import json; d=json.load(open('$R/busy_$v.json'))
for w in ('plain', 'profiled'):
    print('$v', w, 'busy', d[w + '_busy_ms'], {k: (g['launches'], round(g['ms_per_round'], 3)) for k, g in d[w + '_by_kind'].items()})
print('$v', d['kernel_us_by_kind'].get('attention'), [(g['grid'], g['launches'], g['median_us']) for g in d['attention_launches']])" 2>&1 | tail -3; t
done
PYTHONPATH=$NEW timeout -k 5 $(cap 40) python3 benchmarks/kernels/prefill_attn_sweep.py --cases 1x2048+0,16x128+0,4x512+512 --replays 10 --graph-rows 64 --grid m64_n32_w4_st3,m64_n32_w4_st2 --out $R/attn_n32.json > $R/attn_n32.log 2>&1
grep -vE "^\[" $R/attn_n32.log | cut -c1-130; t
