#!/usr/bin/env bash
# Issue 27 on the H200: the GPU check of deferred deep batching, then ouro-bench 1.4B 128/512 at C64 (256
# requests: 4 waves) and C256 (256: one wave): full depth, and deferred / eager same-readout for B = 8, 16, 4.
set -u
T0=$(date +%s)
source .device-bundle/activate.sh
export OURO_CACHE_DIR=/tmp/ourocache PYTHONPATH=$PWD
R=$OUT/runs; mkdir -p $R
timeout 130 python3 -m pytest -q -x tests/test_gpu.py -k deferred_deep > $R/gpu_tests.log 2>&1; echo "gpu tests rc=$?" >> $R/gpu_tests.log
tail -3 $R/gpu_tests.log; echo "t=$(( $(date +%s) - T0 ))"
B="python3 -m ouro_backend.entrypoints.bench --shape ouro-1.4b --baseline none --repeats 1 --input-len 128 --output-len 512 --concurrency 64 256 --num-requests 256 --engine-arg max_num_seqs=256"
b() { local name=$1 lim=$2; shift 2
  echo "+ $B $*" > $R/$name.log
  timeout $lim $B "$@" --out $R/$name.json >> $R/$name.log 2>&1 || echo "$name rc=$?" >> $R/errors.txt
  grep -A4 "^ *in 128" $R/$name.log | tail -3; echo "t=$(( $(date +%s) - T0 ))"; }
b full 90 --label full
for I in 8 16 4; do
  b deferred_b$I 75 --label deferred_b$I --engine-arg deferred_deep_interval=$I
  b eager_b$I 90 --label eager_b$I --engine-arg deferred_deep_interval=$I --engine-arg deferred_deep_eager=true
done
echo "t=$(( $(date +%s) - T0 ))"
