#!/usr/bin/env bash
# Session 2026-12-07 #6, call F (issue 30): why call E's ouro-bench rounds did not move while the profiled prompt
# and the isolated sweep did. From the repository root (the packed grid in the working tree, main c1ce666's
# attention.py in .calls/attention_head.py), carrying .device-bundle:
#  1. a fresh 2,048-token prompt, new / head / new / head, timed without the profiler (median of 3) and profiled;
#  2. the same with programmatic dependent launch off (OURO_PDL=0), new / head;
#  3. the sweep as a mixed graph launches (64 rows) with OURO_PDL=0, new / head.
set -u
DL=${DL:-330}
source benchmarks/device_call.sh cF
t; cat $R/host.txt
NEW=$PWD
rm -rf /tmp/head_tree; mkdir -p /tmp/head_tree; cp -r ouro_backend /tmp/head_tree/; cp .calls/attention_head.py /tmp/head_tree/ouro_backend/kernels/attention.py
path() { case $1 in new*) echo $NEW;; head*) echo /tmp/head_tree:$NEW;; esac; }
PYTHONPATH=$NEW timeout -k 5 $(cap 150) python3 -c "from ouro_backend.entrypoints.bench import ensure_shape_checkpoint as e; print(e('ouro-1.4b'))" > $R/checkpoint.log 2>&1; tail -1 $R/checkpoint.log; t
prof() {  # label [env...]
  local l=$1; shift
  env "$@" PYTHONPATH=$(path $l) timeout -k 5 $(cap 45) python3 benchmarks/round_profile.py --prompt-tokens 2048 --out $R/prompt_$l.json > $R/prompt_$l.log 2>&1
  python3 -c "
import json; d=json.load(open('$R/prompt_$l.json'))
print('$l', 'plain', d['wall_ms_unprofiled'], 'profiled', d['wall_ms'], d['kernel_us_by_kind'].get('attention'), [(g['grid'], g['launches'], g['median_us']) for g in d['attention_launches']])" 2>&1 | tail -1; t
}
prof new1; prof head1; prof new2; prof head2
prof new_nopdl OURO_PDL=0; prof head_nopdl OURO_PDL=0
for v in new head; do
  OURO_PDL=0 PYTHONPATH=$(path $v) timeout -k 5 $(cap 40) python3 benchmarks/kernels/prefill_attn_sweep.py --cases 1x2048+0,16x128+0 --replays 10 --grid none --graph-rows 64 --out $R/attn_${v}_nopdl.json > $R/attn_${v}_nopdl.log 2>&1
  echo "== $v OURO_PDL=0"; grep -E "default|sdpa " $R/attn_${v}_nopdl.log | cut -c1-110; t
done
