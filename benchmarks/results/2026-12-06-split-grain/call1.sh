#!/usr/bin/env bash
# Session 2026-12-06 #4, call 1 (main dba2b66): GPU tests of decode attention at the engine's config (32-key
# tiles at one row) and the GPU oracle/bf16 tests; 32 vs 64 keys at one row for contexts 256/1024/4096; the
# decode rounds (roofline); 4 splits at 4 rows end to end (C4, A/B/A/B, launch patched in the bench process);
# C1 and C64 steady (512 requests) status.
set -u
DL=${DL:-580}
source benchmarks/device_call.sh c1
export PYTHONPATH=$PWD
t; cat $R/host.txt
timeout $(cap 90) python3 -m pytest -q tests/test_kernels.py -k "engines_config_on_the_real_shape or table_configs" > $R/kernel_tests.log 2>&1; tail -1 $R/kernel_tests.log; t
timeout $(cap 170) python3 -m pytest -q -x tests/test_gpu.py -k "bf16 or greedy_equals_oracle" > $R/gpu_tests.log 2>&1; tail -1 $R/gpu_tests.log; t
for c in 256 1024 4096; do
  [ $(left) -lt 300 ] && break
  timeout $(cap 40) python3 benchmarks/kernels/loop_bench.py variants --rows 1 --context $c --replays 30 --names attn_s8_n64 --out $R/ctx$c.json > $R/ctx$c.log 2>&1; echo ctx=$c; cut -c1-100 $R/ctx$c.log | grep M=; t
done
timeout $(cap 60) python3 benchmarks/roofline.py --hbm-tb-s $HBM --label main --out $R/roofline_main.json > $R/roofline.log 2>&1; python3 -c "import json;d=json.load(open('$R/roofline_main.json'));print(d['decode_loop'], d.get('prompt_chunk_2048_ms'))"; t
s4() {
  python3 -c "
import sys
from ouro_backend.kernels import attention as A
orig = A.auto_num_splits
A.auto_num_splits = lambda R, kvh, q, dev: 4 if R in (3, 4) and q == 1 else orig(R, kvh, q, dev)
from ouro_backend.entrypoints.bench import main
sys.exit(main(sys.argv[1:]))
" "$@"
}
B="--shape ouro-1.4b --baseline none --input-len 128 --output-len 64 --repeats 2 --workload full"
for side in base s4 s4b baseb; do
  [ $(left) -lt 100 ] && { echo "skip $side"; continue; }
  if [[ $side == base* ]]; then timeout $(cap 45) python3 -m ouro_backend.entrypoints.bench $B --concurrency 4 --label $side --out $R/c4_$side.json > $R/c4_$side.log 2>&1
  else timeout $(cap 45) s4 $B --concurrency 4 --label $side --out $R/c4_$side.json > $R/c4_$side.log 2>&1; fi
  echo "$side $(t)"; grep -E "^(full|thr)" $R/c4_$side.log | cut -c1-100 | head -2
done
[ $(left) -gt 40 ] && { timeout $(cap 40) python3 -m ouro_backend.entrypoints.bench $B --concurrency 1 --label c1 --out $R/c1.json > $R/c1.log 2>&1; grep -E "^(full|thr)" $R/c1.log | cut -c1-100 | head -2; t; }
[ $(left) -gt 50 ] && { timeout $(cap 70) python3 -m ouro_backend.entrypoints.bench --shape ouro-1.4b --baseline none --input-len 128 --output-len 64 --repeats 1 --workload full --concurrency 64 --num-requests 512 --label c64 --out $R/c64.json > $R/c64.log 2>&1; grep -E "^(full|thr)" $R/c64.log | cut -c1-100 | head -2; t; }
