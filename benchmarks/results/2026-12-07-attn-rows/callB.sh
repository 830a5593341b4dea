#!/usr/bin/env bash
# Session 2026-12-07, call B: tests/test_gpu.py whole (the fp32 oracle on the GPU), serially; the greedy-oracle and
# staggered-request tests first (in case the call is cut), then the rest. pytest -v logs as it goes.
set -u
DL=${DL:-585}
source benchmarks/device_call.sh cB
export PYTHONPATH=$PWD
t; cat $R/host.txt
K="greedy_equals_oracle or staggered"
timeout -k 5 $(cap 300) python3 -m pytest -v -p no:cacheprovider --durations=5 tests/test_gpu.py -k "$K" > $R/gpu_tests_1.log 2>&1
echo "rc=$?" >> $R/gpu_tests_1.log; grep -E "FAILED|ERROR|passed|failed|rc=" $R/gpu_tests_1.log | tail -8; t
timeout -k 5 $(cap 560) python3 -m pytest -v -p no:cacheprovider --durations=5 tests/test_gpu.py -k "not ($K)" > $R/gpu_tests_2.log 2>&1
echo "rc=$?" >> $R/gpu_tests_2.log; grep -E "FAILED|ERROR|passed|failed|rc=" $R/gpu_tests_2.log | tail -8; t
