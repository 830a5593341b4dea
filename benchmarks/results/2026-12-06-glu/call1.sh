#!/usr/bin/env bash
# Session 2026-12-06: the SiLU-mul in gate/up's epilogue (GLU) against in down's x load: kernel tests, the MLP
# pair, the decode rounds (roofline) and ouro-bench with OURO_GLU=0/1; the GPU oracle tests.
set -u
DL=${DL:-440}
source benchmarks/device_call.sh c1
export PYTHONPATH=$PWD
t; cat $R/host.txt
timeout $(cap 80) python3 -m pytest -q tests/test_kernels.py -k "glu or mlp or table_configs" > $R/kernel_tests.log 2>&1; tail -1 $R/kernel_tests.log; t
timeout $(cap 60) python3 benchmarks/kernels/mlp_bench.py --sections pair --hbm-tb-s $HBM --out $R/mlp_pair.json > $R/mlp_pair.log 2>&1; cut -c1-250 $R/mlp_pair.log; t
for g in 0 1; do OURO_GLU=$g timeout $(cap 45) python3 benchmarks/roofline.py --hbm-tb-s $HBM --label glu$g --out $R/roofline_glu$g.json > $R/roofline_glu$g.log 2>&1; python3 -c "import json;d=json.load(open('$R/roofline_glu$g.json'));print('glu$g',d['decode_loop'])"; done; t
B="--shape ouro-1.4b --baseline none --input-len 128 --output-len 64 --repeats 2 --workload full --concurrency 1 16"
for side in 0 1; do
  [ $(left) -lt 100 ] && { echo "skip glu$side"; continue; }
  OURO_GLU=$side timeout $(cap 70) python3 -m ouro_backend.entrypoints.bench $B --label glu$side \
    --out $R/bench_glu$side.json > $R/bench_glu$side.log 2>&1; echo "glu$side $(t)"; grep -E "^(full|thr)" $R/bench_glu$side.log | cut -c1-100 | head -4
done
timeout $(( $(left) - 8 )) python3 -m pytest -q tests/test_gpu.py -k "greedy_equals_oracle or fused_greedy_coda" > $R/gpu_tests.log 2>&1; tail -3 $R/gpu_tests.log; t
