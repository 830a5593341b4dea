#!/usr/bin/env bash
# Ran on main 99bb5b7 (the admission_wait_ms option; reverted in the next commit, 898cae7).
# Issue 29/25: admission grouping (admission_wait_ms) against admission at once, ouro-bench, same call.
set -u
T0=$(date +%s)
source .device-bundle/activate.sh
export OURO_CACHE_DIR=/tmp/ourocache PYTHONPATH=$PWD
R=/tmp/runs; mkdir -p $R
B="python3 -m ouro_backend.entrypoints.bench --shape ouro-1.4b --baseline none --repeats 1 --workload full depth=2.7 depth=1.6 --calibration-requests 64"
b() { local name=$1 lim=$2; shift 2
  echo "+ $B $*" > $R/$name.log
  timeout $lim $B "$@" --out $R/$name.json >> $R/$name.log 2>&1 || echo "$name rc=$?" >> $R/errors.txt
  tar czf $OUT/runs.tgz -C $R .; grep -A6 "^ *in 128" $R/$name.log | tail -5; echo "$name t=$(( $(date +%s) - T0 ))"; }
b c64_64_off 150 --input-len 128 --output-len 64 --concurrency 64 --waves 8 --label wait0
b c64_64_w5 150 --input-len 128 --output-len 64 --concurrency 64 --waves 8 --label wait5 --engine-arg admission_wait_ms=5
b c64_512_w5 170 --input-len 128 --output-len 512 --concurrency 64 --waves 4 --label wait5 --engine-arg admission_wait_ms=5
echo "t=$(( $(date +%s) - T0 ))"
