#!/usr/bin/env bash
# Session 2026-12-07 #7, call A (issues 30 and 29 on the H200, main b3e316b, no engine change): the roofline
# (one-round graphs replayed alone), then ouro-bench end to end with fresh prompts (the prefix cache emptied
# before every timed run): C1 128/64; C16 and C64 128/64, 8 waves, full depth and the real gate at depths 2.7
# and 1.6 (issue 29's rows and issue 30's C64 steady state); C256 64/64, 1,024 requests; C128 1,024/128, 256
# requests. From the repository root, carrying .device-bundle (not needed here: torch is on the device).
set -u
DL=${DL:-560}
source benchmarks/device_call.sh cA
t; cat $R/host.txt
export PYTHONPATH=$PWD
timeout -k 5 $(cap 120) python3 -c "from ouro_backend.entrypoints.bench import ensure_shape_checkpoint as e; print(e('ouro-1.4b'))" > $R/checkpoint.log 2>&1; tail -1 $R/checkpoint.log; t
timeout -k 5 $(cap 90) python3 benchmarks/roofline.py --hbm-tb-s $HBM --label main-b3e316b --out $R/roofline_main.json > $R/roofline.log 2>&1
python3 -c "import json; d=json.load(open('$R/roofline_main.json')); print('decode_loop', d['decode_loop'], 'prompt', d.get('prompt_chunk_2048_ms'))"; t
B="python3 -m ouro_backend.entrypoints.bench --shape ouro-1.4b --baseline none"
b() {  # name cap args...
  local name=$1 c=$2; shift 2
  echo "+ $B $*" > $R/$name.log
  timeout -k 5 $(cap $c) $B "$@" --out $R/$name.json >> $R/$name.log 2>&1 || echo "$name rc=$?" >> $R/errors.txt
  grep -A14 "^ *in [0-9]* / out" $R/$name.log | cut -c1-175; t
}
b c1_128_64 60 --input-len 128 --output-len 64 --concurrency 1 --num-requests 8 --repeats 3 --workload full
b c16_c64_128_64 210 --input-len 128 --output-len 64 --concurrency 16 64 --waves 8 --repeats 1 --workload full depth=2.7 depth=1.6 --calibration-requests 64
b c256_64_64 90 --input-len 64 --output-len 64 --concurrency 256 --num-requests 1024 --repeats 1 --workload full
b c128_1k_128 100 --input-len 1024 --output-len 128 --concurrency 128 --num-requests 256 --repeats 1 --workload full
