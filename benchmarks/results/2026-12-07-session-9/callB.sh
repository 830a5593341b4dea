#!/usr/bin/env bash
# Session 2026-12-07 #9, call B: branch `mixed-rows` (main c3a488c + mixed graphs beside 16 bound rows for
# prompt-token buckets up to 512) against main, from the repository root of the branch after
#   git archive main ouro_backend | tar x -C .calls/main_tree   (its ouro_backend/models dropped: linked below)
# 1. the GPU oracle tests of staggered requests with 4-row mixed graphs (few_rows=4); if they fail, one case
#    again with OURO_FUSED_CODA=0;
# 2. issue 29's C16 128/64 (8 waves, full depth and the real gate at depths 2.7 and 1.6): main, the branch (if
#    its tests passed), then the branch and main again while time is left.
set -u
DL=${DL:-570}
source benchmarks/device_call.sh cB
R=$(realpath "$R")
t; cat $R/host.txt
NEW=$PWD
ln -sfn $NEW/ouro_backend/models .calls/main_tree/ouro_backend/models
PYTHONPATH=$NEW timeout -k 5 $(cap 100) python3 -c "from ouro_backend.entrypoints.bench import ensure_shape_checkpoint as e; print(e('ouro-1.4b'))" > $R/checkpoint.log 2>&1 &
PYTHONPATH=$NEW OURO_TEST_DEVICE=cuda timeout -k 5 $(cap 300) python3 -m pytest -q -p no:cacheprovider -o faulthandler_timeout=120 tests/test_gpu.py -k "staggered and 4-" > $R/gpu_tests.log 2>&1; rc=$?; echo "rc=$rc" >> $R/gpu_tests.log
tail -3 $R/gpu_tests.log; t
if [ $rc != 0 ]; then
  PYTHONPATH=$NEW OURO_FUSED_CODA=0 OURO_TEST_DEVICE=cuda timeout -k 5 $(cap 90) python3 -m pytest -q -p no:cacheprovider -o faulthandler_timeout=60 tests/test_gpu.py -k "staggered and 4-ouro-last" > $R/gpu_tests_nocoda.log 2>&1; echo "rc=$?" >> $R/gpu_tests_nocoda.log
  tail -3 $R/gpu_tests_nocoda.log; t
fi
wait; tail -1 $R/checkpoint.log; t
B="python3 -m ouro_backend.entrypoints.bench --shape ouro-1.4b --baseline none --repeats 1"
b() {  # name tree cap args... (run from the tree: `python3 -m` puts the working directory first on sys.path)
  local name=$1 tree=$2 c=$3; shift 3
  echo "+ (cd $tree && $B $*)" > $R/$name.log
  (cd $tree && timeout -k 5 $(cap $c) $B "$@" --label $name --out $R/$name.json >> $R/$name.log 2>&1) || echo "$name rc=$?" >> $R/errors.txt
  grep -A9 "^ *in [0-9]* / out" $R/$name.log | cut -c1-250; grep -h "captured CUDA graphs" $R/$name.log | cut -c1-300; t
}
W="--input-len 128 --output-len 64 --concurrency 16 --waves 8 --workload full depth=2.7 depth=1.6 --calibration-requests 64"
MAIN=$NEW/.calls/main_tree
b c16_main $MAIN 110 $W
if [ $rc = 0 ]; then
  b c16_branch $NEW 110 $W
  [ $(left) -gt 110 ] && b c16_branch2 $NEW 110 $W
  [ $(left) -gt 110 ] && b c16_main2 $MAIN 110 $W
fi
