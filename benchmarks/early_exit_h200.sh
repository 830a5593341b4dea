#!/usr/bin/env bash
# Issue "early exit that pays", on the H200: the GPU correctness tests, then ouro-bench on the Ouro-1.4B
# shape (random bf16 weights, 128 in / 64 out, greedy, EOS ignored, closed loop of 2x concurrency requests,
# end to end) for full depth and the real gate at the thresholds that give mean depths of about 2.7, 1.6
# and 1.0 on the run's prompts (found by the bench, reported per row), median of 3; then a longer run at
# C64 (8x concurrency requests) that shows how much of the gap is the closed run's tail.
# With a checkout of the previous engine in .old/ (git worktree add .old <commit>), the same bench runs on
# it first: before and after in one call. SKIP_TESTS=1 / SKIP_BENCH=1 skip a half (each fits one device
# call). Results go to $OUT (or ./early-exit-out).
set -uo pipefail
out=${OUT:-early-exit-out}; mkdir -p "$out"; out=$(cd "$out" && pwd)
export OURO_CACHE_DIR=${OURO_CACHE_DIR:-/tmp/ourocache} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
bench="--shape ouro-1.4b --repeats 3 --baseline none"
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout 560 python3 -m pytest -q tests/test_gpu.py tests/test_async_scheduling.py tests/test_kernels.py 2>&1 \
    | grep -v CUDAGraph.cpp > "$out/gpu_tests.log"; tail -n 3 "$out/gpu_tests.log"
fi
[ -n "${SKIP_BENCH:-}" ] && exit 0
if [ -d .old ]; then
  (cd .old && PYTHONPATH=$PWD timeout 250 python3 -m ouro_backend.bench $bench --concurrency 1 16 64 \
    --workload full threshold=0.8 threshold=0.5 --label before --out "$out/before.json" > "$out/before.log" 2>&1)
fi
timeout 330 python3 -m ouro_backend.entrypoints.bench $bench --concurrency 1 16 64 --workload full depth=2.7 depth=1.6 depth=1.0 \
  --label after --out "$out/after.json" > "$out/after.log" 2>&1
timeout 200 python3 -m ouro_backend.entrypoints.bench $bench --concurrency 64 --num-requests 512 --workload full depth=2.7 depth=1.6 \
  --label long --out "$out/long.json" > "$out/long.log" 2>&1
python3 benchmarks/early_exit_rows.py "$out"/before.json "$out"/after.json "$out"/long.json --out "$out/rows.json"
