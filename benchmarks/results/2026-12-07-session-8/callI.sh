#!/usr/bin/env bash
# Session 2026-12-07 #8, call I (replaces call H, which found no machine): branch `mixed-rows` (main 7aed006 + 16-row
# mixed graphs beside chunks of up to 512 tokens) against main, from the repository root of the branch after
#   git archive main ouro_backend | tar x -C .calls/main_tree   (its ouro_backend/models dropped: linked below)
# 1. the GPU oracle tests of staggered requests (with 4-row mixed graphs too: few_rows=4), 120 s at most;
# 2. issue 29's C16 128/64 (8 waves, full depth and the real gate at depths 2.7 and 1.6), main then the branch
#    (the branch only if its tests passed);
# 3. issue 29's open loop: Poisson arrivals at 0.8 of full depth's C64 capacity, 128/256, 256 requests, full depth
#    and the gate at 2.7 and 1.6, on the branch (main if the branch's tests failed), if 140 s are left.
set -u
DL=${DL:-560}  # it ran with DL=330
source benchmarks/device_call.sh cI
R=$(realpath "$R")
t; cat $R/host.txt
NEW=$PWD
ln -sfn $NEW/ouro_backend/models .calls/main_tree/ouro_backend/models
PYTHONPATH=$NEW timeout -k 5 $(cap 100) python3 -c "from ouro_backend.entrypoints.bench import ensure_shape_checkpoint as e; print(e('ouro-1.4b'))" > $R/checkpoint.log 2>&1 &
PYTHONPATH=$NEW OURO_TEST_DEVICE=cuda timeout -k 5 $(cap 120) python3 -m pytest -q -p no:cacheprovider -o faulthandler_timeout=60 tests/test_gpu.py -k staggered > $R/gpu_tests.log 2>&1; rc=$?; echo "rc=$rc" >> $R/gpu_tests.log
wait; tail -1 $R/checkpoint.log; tail -3 $R/gpu_tests.log; t
B="python3 -m ouro_backend.entrypoints.bench --shape ouro-1.4b --baseline none --repeats 1"
b() {  # name tree cap args... (run from the tree: `python3 -m` puts the working directory first on sys.path)
  local name=$1 tree=$2 c=$3; shift 3
  echo "+ (cd $tree && $B $*)" > $R/$name.log
  (cd $tree && timeout -k 5 $(cap $c) $B "$@" --label $name --out $R/$name.json >> $R/$name.log 2>&1) || echo "$name rc=$?" >> $R/errors.txt
  grep -A9 "^ *in [0-9]* / out" $R/$name.log | cut -c1-250; t
}
W="--input-len 128 --output-len 64 --concurrency 16 --waves 8 --workload full depth=2.7 depth=1.6 --calibration-requests 64"
MAIN=$NEW/.calls/main_tree
b c16_main $MAIN 100 $W
OPEN="--input-len 128 --output-len 256 --concurrency 64 --arrival-load 0.8 --num-requests 256 --workload full depth=2.7 depth=1.6 --calibration-requests 64"
if [ $rc = 0 ]; then
  b c16_branch $NEW 100 $W
  [ $(left) -gt 140 ] && b open_c64_128_256_branch $NEW 170 $OPEN
else
  [ $(left) -gt 140 ] && b open_c64_128_256_main $MAIN 170 $OPEN
fi
