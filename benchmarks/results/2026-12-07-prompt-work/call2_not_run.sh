#!/usr/bin/env bash
# Session 2026-12-07 #4, call 2 (issue 30, prompt work): prompt attention's whole tiles below a tile's first
# query without masks, 64x64 tiles / 4 warps / 3 stages, against main (`.calls/main_tree`, main's package):
# the GPU kernel tests, a 2,048-token prompt profiled on both, the sweep's best configs on the new kernel.
set -u
DL=${DL:-250}
source benchmarks/device_call.sh c2
t; cat $R/host.txt
NEW=$PWD; OLD=$PWD/.calls/main_tree:$PWD
PYTHONPATH=$NEW timeout -k 5 $(cap 50) python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "paged or attention or decode_launch or skip_the_mask" > $R/kernel_tests.log 2>&1; echo "kernel tests: $(tail -1 $R/kernel_tests.log)"; t
prof() {  # label pythonpath
  PYTHONPATH=$2 timeout -k 5 $(cap 55) python3 benchmarks/round_profile.py --prompt-tokens 2048 --out $R/prompt_$1.json > $R/prompt_$1.log 2>&1
  python3 -c "import json;d=json.load(open('$R/prompt_$1.json')); print('$1', d['wall_ms'], d['kernel_us_by_kind'].get('attention'), d.get('attention_tflops'), d['all_tflops'])" 2>&1 | tail -1; t
}
prof new $NEW; prof old "$OLD"
PYTHONPATH=$NEW timeout -k 5 $(cap 45) python3 benchmarks/kernels/prefill_attn_sweep.py --cases 1x2048+0,16x128+0 --replays 10 --grid m64_n64_w4_st3,m128_n64_w8_st3,m128_n128_w8_st3,m64_n64_w4_st2 --out $R/attn_new.json > $R/attn_new.log 2>&1
grep -vE "^\[" $R/attn_new.log | cut -c1-150; t
PYTHONPATH=$OLD timeout -k 5 $(cap 30) python3 benchmarks/kernels/prefill_attn_sweep.py --cases 1x2048+0,16x128+0 --replays 10 --grid m64_n64_w4_st3 --out $R/attn_old.json > $R/attn_old.log 2>&1
grep -E "default|m64_n64_w4_st3" $R/attn_old.log | cut -c1-150; t
