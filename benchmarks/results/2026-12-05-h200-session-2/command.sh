#!/usr/bin/env bash
# The one device call of this folder (H200, 2026-12-05, second session), run from the repository root at main
# 05bdb29 with .wt-mixed-rows, .wt-tma-linear, .wt-lm-head-skip carried: each
#   git archive <branch> ouro_backend benchmarks tests pyproject.toml (demo model and results removed).
# bench()'s --label reads its third argument after a shift (ouro-1.4b), not the branch; the --out names are right.
# Call 1 (2026-12-05, second H200 session): the branches' correctness on the GPU, then the bench that decides
# them. tma-linear: its linear kernel tests (the real-shape table test of the new configs); lm-head-skip: its
# GPU test and kernel test; mixed-rows: the GPU oracle tests that replay mixed rounds under graphs (greedy with
# graphs, staggered requests, the new row-bucket test, preemption). Then ouro-bench C16 128/64, 8 waves, full
# and the real gate bisected to depth 1.6, for main, mixed-rows and tma-linear; C64 128/64 512 requests for
# main and mixed-rows. Each bench a fresh engine (prefix cache empty).
set -u
export PYTHONUNBUFFERED=1 OURO_CACHE_DIR=/tmp/ourocache
T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee $OUT/gpu.txt
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a $OUT/gpu.txt
t() { echo "t=$(( $(date +%s) - T0 )) $1"; }
(cd .wt-tma-linear && PYTHONPATH=$PWD timeout 80 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k linear > $OUT/tma_linear_tests.log 2>&1; echo "rc=$?" >> $OUT/tma_linear_tests.log)
tail -3 $OUT/tma_linear_tests.log; t tma
(cd .wt-lm-head-skip && PYTHONPATH=$PWD timeout 70 python3 -m pytest -v -p no:cacheprovider tests/test_gpu.py tests/test_kernels.py -k "coda_only or rows_advance_lets_emit" > $OUT/lmskip_tests.log 2>&1; echo "rc=$?" >> $OUT/lmskip_tests.log)
grep -E "PASSED|FAILED|ERROR|passed|failed|rc=" $OUT/lmskip_tests.log | tail -9; t lmskip
(cd .wt-mixed-rows && PYTHONPATH=$PWD timeout 260 python3 -m pytest -v -p no:cacheprovider --durations=8 tests/test_gpu.py \
  -k "mixed or staggered or preemption or (greedy_equals_oracle and True and not cublas)" > $OUT/mixed_rows_tests.log 2>&1; echo "rc=$?" >> $OUT/mixed_rows_tests.log)
grep -cE "PASSED" $OUT/mixed_rows_tests.log; grep -E "FAILED|ERROR|passed|failed|rc=" $OUT/mixed_rows_tests.log | tail -8; t mixed
tree() { [ $1 = main ] && echo $PWD || echo $PWD/.wt-$1; }
bench() {  # name side timeout args...
  name=$1; d=$(tree $2); to=$3; shift 3
  left=$(( 590 - ($(date +%s) - T0) )); [ $left -lt 30 ] && { echo "skip $name"; return; }
  [ $to -gt $left ] && to=$left
  echo "+ (cd $d) python3 -m ouro_backend.entrypoints.bench $* --label $2" >> $OUT/bench.log
  (cd $d && PYTHONPATH=$d timeout $to python3 -m ouro_backend.entrypoints.bench "$@" --label $2 --out $OUT/$name.json) 2>&1 \
    | grep -v Warn | tee -a $OUT/bench.log | grep -E "rep [0-9]|^full  |^depth=" | tail -2
  t $name
}
S="--shape ouro-1.4b --baseline none --input-len 128 --output-len 64"
for side in mixed-rows main tma-linear; do
  bench c16_$side $side 60 $S --concurrency 16 --waves 8 --repeats 1 --workload full depth=1.6 --calibration-requests 64
done
for side in mixed-rows main; do
  bench c64_$side $side 60 $S --concurrency 64 --num-requests 512 --repeats 1 --workload full depth=1.6 --calibration-requests 128
done
