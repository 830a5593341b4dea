#!/usr/bin/env bash
# Session 2026-12-06 #5, call B: tests/test_gpu.py whole (the fp32 oracle on the GPU), serially.
set -u
DL=${DL:-585}
source benchmarks/device_call.sh cB
export PYTHONPATH=$PWD
t; cat $R/host.txt
timeout -k 5 $(cap 570) python3 -m pytest -v -p no:cacheprovider --durations=10 tests/test_gpu.py > $R/gpu_tests.log 2>&1
echo "rc=$?" >> $R/gpu_tests.log
grep -cE "PASSED" $R/gpu_tests.log; grep -E "FAILED|ERROR|passed|failed|rc=" $R/gpu_tests.log | tail -20; t
