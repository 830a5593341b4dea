#!/usr/bin/env bash
# Issue 25: served vs engine-direct at C256, 64/64, 1,024 distinct prompts: full depth and the gate at depth 1.6.
set -u
T0=$(date +%s)
source .device-bundle/activate.sh
export OURO_CACHE_DIR=/tmp/ourocache PYTHONPATH=$PWD
R=$OUT/runs; mkdir -p $R
run() { local name=$1; shift
  echo "+ python3 benchmarks/served.py --concurrency 256 --requests 1024 --input-len 64 --output-len 64 --repeats 1 --skip-perf-analyzer $*" > $R/$name.log
  timeout 285 python3 benchmarks/served.py --concurrency 256 --requests 1024 --input-len 64 --output-len 64 --repeats 1 \
    --skip-perf-analyzer "$@" --out $R/$name >> $R/$name.log 2>&1 || echo "$name rc=$?" >> $R/errors.txt
  tail -12 $R/$name.log; echo "t=$(( $(date +%s) - T0 ))"; }
run c256_full --port-base 19000
run c256_gate --port-base 19100 --depth 1.6
