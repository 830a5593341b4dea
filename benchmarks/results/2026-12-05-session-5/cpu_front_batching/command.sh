#!/usr/bin/env bash
# Branch front-batching (82d7bc5) against main (18368ba) on the 2-core CPU machine, model replaced by the stand-in
# engine (launches 12 ms); /work/suite = a checkout of main, /work/main = of the branch.
set -u
OUT=/tmp/fb
run() { local label=$1 tree=$2
  (cd $tree && timeout 600 .venv/bin/python benchmarks/served.py --model ouro_backend/models/ouro-demo --stand-in \
    --stand-in-round-ms 12 --concurrency 64 --requests 768 --repeats 1 --skip-perf-analyzer --engine-arg device=cpu \
    --engine-arg num_blocks=8192 --trace --out $OUT/$label > $OUT/$label.log 2>&1; echo "$label rc=$?") ; }
run base1 /work/suite; run batch1 /work/main; run base2 /work/suite; run batch2 /work/main
