#!/usr/bin/env bash
# Issue 29 on the H200: loop efficiency of the real gate against full depth (ouro-bench), PART=1: 128/64 at
# C16/C64 (8 waves) and the open loop 128/256 at 0.8 of full depth's C64 capacity; PART=2: 128/512 at C64
# (4 waves) and the GPU checks of penalties.
set -u
T0=$(date +%s)
source .device-bundle/activate.sh
export OURO_CACHE_DIR=/tmp/ourocache PYTHONPATH=$PWD
R=$OUT/runs; mkdir -p $R
nvidia-smi --query-gpu=name,memory.used --format=csv > $R/gpu.txt
B="python3 -m ouro_backend.entrypoints.bench --shape ouro-1.4b --baseline none --repeats 1 --workload full depth=2.7 depth=1.6"
b() { local name=$1 lim=$2; shift 2
  echo "+ $B $*" > $R/$name.log
  timeout $lim $B "$@" --out $R/$name.json >> $R/$name.log 2>&1 || echo "$name rc=$?" >> $R/errors.txt
  grep -A12 "^ *in 128" $R/$name.log | tail -14; echo "t=$(( $(date +%s) - T0 ))"; }
if [ "${PART:-1}" = 1 ]; then
  b c16_c64_128_64 260 --input-len 128 --output-len 64 --concurrency 16 64 --waves 8 --calibration-requests 64
  b open_128_256 300 --input-len 128 --output-len 256 --concurrency 64 --num-requests 256 --arrival-load 0.8 --calibration-requests 64
else
  b c64_128_512 330 --input-len 128 --output-len 512 --concurrency 64 --waves 4 --calibration-requests 64
  timeout 240 python3 -m pytest -q -x tests/test_gpu.py -k "penalt or seeded_sampling_same or sampled_speculation or logprob" > $R/gpu_tests.log 2>&1; echo "gpu tests rc=$?" >> $R/gpu_tests.log
  tail -5 $R/gpu_tests.log
fi
echo "t=$(( $(date +%s) - T0 ))"
