#!/usr/bin/env bash
# Branch front-batching (0a0fd7e) against main (61dbb2d): one wave of 64 requests per repeat (every request sent at once), model replaced by the
# stand-in engine (12 ms launches), 16 output tokens; main (/work/suite) against the branch (/work/fbwt).
set -u
OUT=/tmp/fb
run() { local label=$1 tree=$2
  (cd $tree && timeout 600 .venv/bin/python benchmarks/served.py --model ouro_backend/models/ouro-demo --stand-in \
    --stand-in-round-ms 12 --concurrency 64 --requests 64 --repeats 5 --output-len 16 --skip-perf-analyzer \
    --engine-arg device=cpu --engine-arg num_blocks=8192 --trace --out $OUT/$label > $OUT/$label.log 2>&1; echo "$label rc=$?") ; }
run wbase1 /work/suite; run wbatch1 /work/fbwt; run wbase2 /work/suite; run wbatch2 /work/fbwt
