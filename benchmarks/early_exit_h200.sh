#!/usr/bin/env bash
# Issue "early exit that pays", on the H200: GPU correctness tests, then ouro-bench on the Ouro-1.4B shape
# (random bf16 weights, 128 in / 64 out, greedy, EOS ignored, closed loop of 2x concurrency requests, end to
# end) for full depth and the real gate at thresholds 0.8 and 0.5, median of 3. With a checkout of the
# previous engine in .old/ (git worktree add .old <commit>), the same bench runs on it first: before and
# after in one call. Results go to $OUT (or ./early-exit-out).
set -uo pipefail
out=${OUT:-early-exit-out}; mkdir -p "$out"; out=$(cd "$out" && pwd)
export OURO_CACHE_DIR=${OURO_CACHE_DIR:-/tmp/ourocache} PYTHONUNBUFFERED=1
bench="--shape ouro-1.4b --concurrency 1 16 64 --workload full threshold=0.8 threshold=0.5 --repeats 3 --baseline none"
[ -n "${SKIP_TESTS:-}" ] || PYTHONPATH=$PWD timeout 200 python3 -m pytest -q tests/test_gpu.py -k "mixed or trace or seeded or (greedy and 4-0.5)" \
  2>&1 | grep -v CUDAGraph.cpp > "$out/gpu_tests.log"; tail -2 "$out/gpu_tests.log"
if [ -d .old ]; then
  (cd .old && PYTHONPATH=$PWD timeout 200 python3 -m ouro_backend.bench $bench --label before --out "$out/before.json" > "$out/before.log" 2>&1)
fi
PYTHONPATH=$PWD timeout 200 python3 -m ouro_backend.bench $bench --label after --out "$out/after.json" > "$out/after.log" 2>&1
PYTHONPATH=$PWD python3 benchmarks/early_exit_rows.py "$out"/before.json "$out"/after.json --out "$out/rows.json"
