#!/usr/bin/env bash
# The device call behind this folder (one H200, from the repository root, .device-bundle carried; the demo
# model's folder was left out of the copy to fit the 64 MiB limit: these runs serve the ouro-1.4b shape).
set -u
source .device-bundle/activate.sh
export OURO_CACHE_DIR=/tmp/ourocache PYTHONPATH=$PWD PYTHONUNBUFFERED=1
R=$OUT/runs; mkdir -p $R; port=19000
run() {
  name=$1; shift
  echo "+ python3 benchmarks/served.py $*" > $R/$name.log
  timeout ${STEP_TIMEOUT:-270} python3 benchmarks/served.py "$@" --port-base $port --out $R/$name >> $R/$name.log 2>&1 \
    || echo "$name rc=$?" >> $R/errors.txt
  port=$((port+100))
  grep -E "tok/s|ratio|in_flight|threads" $R/$name.log | tail -8
}
# perf_analyzer with --max-threads 64, then its default 16, each with a fresh server (empty prefix cache) and
# distinct prompts; the second skips engine-direct (the first's is the baseline). In the tree that ran,
# run_perf.py passed --max-threads max(16, C) by default (reverted after this call); with the committed code
# the first run is:
run c64_full --concurrency 64 --requests 512 --repeats 1 --perf-analyzer-max-threads 64
run c64_full_t16 --concurrency 64 --requests 512 --repeats 1 --skip-direct --perf-analyzer-max-threads 16
cd $OUT && tar czf runs.tgz runs && rm -rf runs
