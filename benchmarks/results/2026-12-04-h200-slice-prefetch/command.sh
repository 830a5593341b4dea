#!/usr/bin/env bash
# The device call behind this folder's numbers (one H200, run from the repository root). "base" is main
# before the change (`git archive HEAD ouro_backend benchmarks/roofline.py benchmarks/graph_timing.py` into
# .base, carried); "after" is the working tree. Each workload runs base then after, in the same call.
set -u
export PYTHONUNBUFFERED=1
B="--shape ouro-1.4b --baseline none --input-len 128 --output-len 64"
(PYTHONPATH=$PWD python3 -m pytest -q tests/test_kernels.py -k linear 2>&1 | tail -3) | tee $OUT/gpu_tests.log
for side in base after; do
  d=$PWD; [ $side = base ] && d=$PWD/.base
  (cd $d && PYTHONPATH=$d python3 benchmarks/roofline.py --label $side --out $OUT/roofline_$side.json 2>&1 | tail -4)
done
for side in base after; do
  d=$PWD; [ $side = base ] && d=$PWD/.base
  (cd $d && PYTHONPATH=$d python3 -m ouro_backend.entrypoints.bench $B --concurrency 1 --repeats 3 \
    --workload full depth=1.8 --label $side --out $OUT/c1_$side.json) 2>&1 | grep -v Warn | tee -a $OUT/bench.log | tail -4
done
for side in base after; do
  d=$PWD; [ $side = base ] && d=$PWD/.base
  (cd $d && PYTHONPATH=$d python3 -m ouro_backend.entrypoints.bench $B --concurrency 64 --num-requests 512 \
    --repeats 1 --workload full depth=1.6 --label $side --out $OUT/c64_$side.json) 2>&1 | grep -v Warn | tee -a $OUT/bench.log | tail -4
done

# A second call (same tree): speculation at C1 with the change (plain and speculative in the same call), and
# the 2.6B shape's C1, base then after.
CHANGES=0.012 SPEC_SETS="spec_tokens=4,spec_draft_loops=1" CONCURRENCY=1 REPEATS=2 OUT=$OUT/spec \
  timeout 270 bash benchmarks/spec_h200.sh; tail -n 3 $OUT/spec/*.log  # (ran as 'tail -3', which printed an error instead)
B26="--shape ouro-2.6b --baseline none --input-len 128 --output-len 64 --concurrency 1 --repeats 3 --workload full"
for side in base after; do
  d=$PWD; [ $side = base ] && d=$PWD/.base
  (cd $d && PYTHONPATH=$d timeout 140 python3 -m ouro_backend.entrypoints.bench $B26 --label $side \
    --out $OUT/c1_26b_$side.json) 2>&1 | grep -v Warn | tee -a $OUT/bench26.log | grep "rep \|^full"
done
