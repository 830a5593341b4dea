#!/usr/bin/env bash
# Session 2026-12-07 #7, call D (issue 30): decode attention's KV splits where few rows hold long contexts.
# Tree: main b3e316b + splits past a row's keys exit at once (no partials, no arrival; the merge reads the used
# ones), attn_sweep.py --live. 1. the GPU kernel tests of attention; 2. ouro-bench with the rules of
# splits_patch.py (.calls/splits_patch.py, a copy beside this script): none; all (every decode launch of 9+ rows
# and a mixed round's decode rows 4 ways, in multiples of 512 keys); mixed (only a mixed round's decode rows), on
# C16 2,048/64 (long contexts) and C64 128/64 (short: what the rule must not slow); 3. with what time is left,
# `attn_sweep.py` with idle rows (`--live`). From the repository root. (Planned at 540 s with more cases; cut to
# this after three refused starts had taken the device time.)
set -u
DL=${DL:-130}
source benchmarks/device_call.sh cD
t; cat $R/host.txt
export PYTHONPATH=$PWD
timeout -k 5 $(cap 80) python3 -c "from ouro_backend.entrypoints.bench import ensure_shape_checkpoint as e; print(e('ouro-1.4b'))" > $R/checkpoint.log 2>&1 &
timeout -k 5 $(cap 50) python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "paged_attention or rope_kv_attention or split" > $R/kernel_tests.log 2>&1; echo "rc=$?" >> $R/kernel_tests.log
wait; tail -1 $R/checkpoint.log; tail -2 $R/kernel_tests.log; t
b() {  # name rule cap args...
  local name=$1 rule=$2 c=$3; shift 3
  [ $rule = none ] && rule=
  echo "+ SPLIT_RULE=$rule python3 .calls/splits_patch.py $*" > $R/$name.log
  SPLIT_RULE=$rule timeout -k 5 $(cap $c) python3 .calls/splits_patch.py --shape ouro-1.4b --baseline none --repeats 1 --workload full \
    "$@" --label $name --out $R/$name.json >> $R/$name.log 2>&1 || echo "$name rc=$?" >> $R/errors.txt
  echo "$name $(grep -E '^full ' $R/$name.log | head -1 | cut -c1-110) $(t)"
}
for rule in none all; do b c16_2k_$rule $rule 38 --input-len 2048 --output-len 64 --concurrency 16 --num-requests 64; done
for rule in none all; do b c64_128_$rule $rule 35 --input-len 128 --output-len 64 --concurrency 64 --waves 4; done
timeout -k 5 $(cap 60) python3 benchmarks/kernels/attn_sweep.py --rows 64,16 --live 2,16,64 --contexts 2048 --skip-loop --replays 10 \
  --grid n64_w2_st2_s2,n64_w2_st2_s4_g512,n64_w2_st2_s8_g256 --out $R/sweep.json > $R/sweep.log 2>&1
grep "rows=" $R/sweep.log | cut -c1-200; t
