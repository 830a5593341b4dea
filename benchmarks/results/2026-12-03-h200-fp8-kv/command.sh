#!/usr/bin/env bash
# Ran on branch fp8-kv at b9b4125 (not merged into main; see README.md).
# Issue 30: the fp8 KV cache on the H200: kernel and engine GPU tests, 1K/128 C128 bf16 vs fp8 KV, greedy agreement.
set -u
T0=$(date +%s)
source .device-bundle/activate.sh
export OURO_CACHE_DIR=/tmp/ourocache PYTHONPATH=$PWD
R=/tmp/runs; mkdir -p $R
t() { echo "$1 t=$(( $(date +%s) - T0 ))"; tar czf $OUT/runs.tgz -C $R .; }
timeout 60 python3 -m pytest -q -x tests/test_kernels.py -k fp8 > $R/kernel_tests.log 2>&1; echo "rc=$?" >> $R/kernel_tests.log; tail -2 $R/kernel_tests.log; t kernels
B="python3 -m ouro_backend.entrypoints.bench --shape ouro-1.4b --baseline none --repeats 1 --workload full --input-len 1024 --output-len 128 --concurrency 128 --num-requests 128"
for kv in auto fp8; do
  echo "+ $B --engine-arg kv_cache_dtype=$kv" > $R/c128_1k_$kv.log
  timeout 60 $B --label kv_$kv --engine-arg kv_cache_dtype=$kv --out $R/c128_1k_$kv.json >> $R/c128_1k_$kv.log 2>&1 || echo "$kv rc=$?" >> $R/errors.txt
  grep -A3 "^workload" $R/c128_1k_$kv.log | head -3; t bench_$kv
done
timeout 50 python3 -m pytest -q -x tests/test_gpu.py -k "fp8_kv and True" > $R/gpu_tests.log 2>&1; echo "rc=$?" >> $R/gpu_tests.log; tail -2 $R/gpu_tests.log; t gpu
timeout 60 python3 benchmarks/kv_fp8_agreement.py --prompts 32 --input-len 512 --output-len 64 --out $R/agreement.json > $R/agreement.log 2>&1; tail -1 $R/agreement.log; t agree
