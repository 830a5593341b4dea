#!/usr/bin/env bash
# Issue 30: the persistent layer tail on the H200: kernel tests, config sweep in the loop, engine GPU tests, C1.
set -u
T0=$(date +%s)
source .device-bundle/activate.sh
export OURO_CACHE_DIR=/tmp/ourocache PYTHONPATH=$PWD
R=/tmp/runs; mkdir -p $R
t() { echo "$1 t=$(( $(date +%s) - T0 ))"; tar czf $OUT/runs.tgz -C $R .; }
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv > $R/gpu.txt
timeout 150 python3 -m pytest -q -x tests/test_kernels.py -k layer_tail > $R/kernel_tests.log 2>&1; echo "rc=$?" >> $R/kernel_tests.log; tail -3 $R/kernel_tests.log; t kernels
timeout 200 python3 benchmarks/kernels/loop_bench.py tail --rows 1,8 --out $R/loop_tail.json > $R/loop_tail.log 2>&1; echo "rc=$?" >> $R/loop_tail.log; cat $R/loop_tail.log | grep -v Warn | tail -16; t tail
timeout 200 python3 -m pytest -q -x tests/test_gpu.py > $R/gpu_tests.log 2>&1; echo "rc=$?" >> $R/gpu_tests.log; tail -3 $R/gpu_tests.log; t gpu
B="python3 -m ouro_backend.entrypoints.bench --shape ouro-1.4b --baseline none --input-len 128 --output-len 64 --concurrency 1 --repeats 3 --workload full"
OURO_LAYER_TAIL=0 timeout 90 $B --label separate --out $R/c1_separate.json > $R/c1_separate.log 2>&1; grep -A2 "^workload" $R/c1_separate.log | head -3; t c1a
timeout 90 $B --label tail --out $R/c1_tail.json > $R/c1_tail.log 2>&1; grep -A2 "^workload" $R/c1_tail.log | head -3; t c1b
