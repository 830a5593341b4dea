#!/usr/bin/env bash
# Prepared in session 2026-12-07 #7 for the next session (issue 30), replacing calls D and E, which found no
# machine. Run from the repository root of branch `decode-splits` (main b3e316b + two attention commits: KV
# splits past a row's keys exit at once; a packed prompt launch runs rows in order, each row's tiles last
# first), after
#   mkdir -p .calls && git show b3e316b:ouro_backend/kernels/attention.py > .calls/attention_main.py \
#     && cp benchmarks/results/2026-12-07-session-7/splits_patch.py .calls/
# (no carry needed: nothing here starts tritonserver). In order:
#  1. the GPU kernel tests of attention on the branch;
#  2. prompt attention as a mixed graph launches it (`--graph-rows 64`): the busy profile's chunk shape (a chunk
#     that continues a prompt after 586 cached tokens, then a new prompt's first 730), a lone 2,048-token prompt
#     and 16 prompts of 128, main's attention.py against the branch's;
#  3. the busy profile of call B (16 fresh 2,048-token prompts at once), main / branch / main / branch;
#  4. ouro-bench with the split rules of splits_patch.py on the branch: none, all, mixed; C16 2,048/64 (long
#     contexts, few rows) and C64 128/64 (short contexts: what a rule must not slow);
#  5. decode attention alone with idle rows (`attn_sweep.py --live`).
set -u
DL=${DL:-570}
source benchmarks/device_call.sh cF
t; cat $R/host.txt
NEW=$PWD
rm -rf /tmp/main_tree; mkdir -p /tmp/main_tree; cp -r ouro_backend /tmp/main_tree/; cp .calls/attention_main.py /tmp/main_tree/ouro_backend/kernels/attention.py
path() { case $1 in branch*) echo $NEW;; main*) echo /tmp/main_tree:$NEW;; esac; }
PYTHONPATH=$NEW timeout -k 5 $(cap 100) python3 -c "from ouro_backend.entrypoints.bench import ensure_shape_checkpoint as e; print(e('ouro-1.4b'))" > $R/checkpoint.log 2>&1 &
PYTHONPATH=$NEW timeout -k 5 $(cap 100) python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "paged_attention or rope_kv_attention or split or packed" > $R/kernel_tests.log 2>&1; echo "rc=$?" >> $R/kernel_tests.log
wait; tail -1 $R/checkpoint.log; tail -2 $R/kernel_tests.log; t
for v in main branch; do
  PYTHONPATH=$(path $v) timeout -k 5 $(cap 50) python3 benchmarks/kernels/prefill_attn_sweep.py --cases 1314+586/730+0,1x2048+0,16x128+0 \
    --graph-rows 64 --replays 10 --grid none --out $R/prompt_attn_$v.json > $R/prompt_attn_$v.log 2>&1
  grep -E "default|sdpa" $R/prompt_attn_$v.log | sed "s/^/$v /" | cut -c1-120; t
done
for v in main1 branch1 main2 branch2; do
  PYTHONPATH=$(path $v) timeout -k 5 $(cap 45) python3 benchmarks/round_profile.py --prompt-tokens 2048 --busy 16 --steps 12 --out $R/busy_$v.json > $R/busy_$v.log 2>&1
  python3 -c "
import json; d=json.load(open('$R/busy_$v.json'))
print('$v busy', d['plain_busy_ms'], {k: (g['launches'], round(g['ms_per_round'], 3)) for k, g in d['plain_by_kind'].items()}, [(g['grid'], g['launches'], g['median_us']) for g in d['attention_launches']])" 2>&1 | tail -1; t
done
b() {  # name rule cap args...
  local name=$1 rule=$2 c=$3; shift 3
  [ $rule = none ] && rule=
  echo "+ SPLIT_RULE=$rule python3 .calls/splits_patch.py $*" > $R/$name.log
  SPLIT_RULE=$rule PYTHONPATH=$NEW timeout -k 5 $(cap $c) python3 .calls/splits_patch.py --shape ouro-1.4b --baseline none --repeats 1 \
    --workload full "$@" --label $name --out $R/$name.json >> $R/$name.log 2>&1 || echo "$name rc=$?" >> $R/errors.txt
  echo "$name $(grep -E '^full ' $R/$name.log | head -1 | cut -c1-110) $(t)"
}
for rule in none all mixed; do b c16_2k_$rule $rule 45 --input-len 2048 --output-len 64 --concurrency 16 --num-requests 64; done
for rule in none all; do b c64_128_$rule $rule 35 --input-len 128 --output-len 64 --concurrency 64 --waves 4; done
PYTHONPATH=$NEW timeout -k 5 $(cap 60) python3 benchmarks/kernels/attn_sweep.py --rows 64,16 --live 2,16,64 --contexts 2048 --skip-loop \
  --replays 10 --grid n64_w2_st2_s2,n64_w2_st2_s4_g512,n64_w2_st2_s8_g256 --out $R/sweep.json > $R/sweep.log 2>&1
grep "rows=" $R/sweep.log | cut -c1-200; t
