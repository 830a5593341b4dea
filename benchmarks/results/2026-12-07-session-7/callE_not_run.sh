#!/usr/bin/env bash
# Session 2026-12-07 #7, call E (H200; issue 30): the split rule call D chose (RULE, splits_patch.py) against none:
# 1. a lone fresh 2,048-token prompt profiled (`round_profile.py --prompt-tokens 2048`) and the busy profile of
# call B (16 such prompts at once), none / RULE / none / RULE; 2. C256 64/64 (1,024 requests) with
# max_num_seqs=256 (call A's C256 ran at the default 64 rows), none / RULE. From the repository root.
set -u
DL=${DL:-420}
RULE=${RULE:?the split rule: mixed or all}
source benchmarks/device_call.sh cE
t; cat $R/host.txt
export PYTHONPATH=$PWD
timeout -k 5 $(cap 100) python3 -c "from ouro_backend.entrypoints.bench import ensure_shape_checkpoint as e; print(e('ouro-1.4b'))" > $R/checkpoint.log 2>&1; tail -1 $R/checkpoint.log; t
for v in none1 ${RULE}1 none2 ${RULE}2; do
  rule=${v%[12]}; [ $rule = none ] && rule=
  SPLIT_RULE=$rule timeout -k 5 $(cap 50) python3 .calls/splits_patch.py benchmarks/round_profile.py --prompt-tokens 2048 --busy 16 --steps 12 --out $R/busy_$v.json > $R/busy_$v.log 2>&1
  python3 -c "
import json; d=json.load(open('$R/busy_$v.json'))
print('$v busy', d['plain_busy_ms'], {k: (g['launches'], round(g['ms_per_round'], 3)) for k, g in d['plain_by_kind'].items()}, [(g['grid'], g['launches'], g['median_us']) for g in d['attention_launches']])" 2>&1 | tail -1; t
done
for v in none $RULE; do
  rule=$v; [ $rule = none ] && rule=
  SPLIT_RULE=$rule timeout -k 5 $(cap 45) python3 .calls/splits_patch.py benchmarks/round_profile.py --prompt-tokens 2048 --out $R/lone_$v.json > $R/lone_$v.log 2>&1
  python3 -c "
import json; d=json.load(open('$R/lone_$v.json'))
print('$v lone', d.get('wall_ms_unprofiled'), d['wall_ms'], d['kernel_us_by_kind'].get('attention'), d['all_tflops'], [(g['grid'], g['launches'], g['median_us']) for g in d['attention_launches']])" 2>&1 | tail -1; t
done
for v in none $RULE; do
  rule=$v; [ $rule = none ] && rule=
  echo "+ SPLIT_RULE=$rule python3 .calls/splits_patch.py ... --input-len 64 --output-len 64 --concurrency 256 --num-requests 1024 --engine-arg max_num_seqs=256" > $R/c256_$v.log
  SPLIT_RULE=$rule timeout -k 5 $(cap 80) python3 .calls/splits_patch.py --shape ouro-1.4b --baseline none --repeats 1 --workload full --input-len 64 --output-len 64 \
    --concurrency 256 --num-requests 1024 --engine-arg max_num_seqs=256 --label c256_$v --out $R/c256_$v.json >> $R/c256_$v.log 2>&1 || echo "c256_$v rc=$?" >> $R/errors.txt
  echo "c256 $v $(grep -E '^full ' $R/c256_$v.log | head -1 | cut -c1-120)"; t
done
