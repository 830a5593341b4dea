#!/usr/bin/env bash
# The `ouro` front's CPU per token, base against after, with the model replaced (CPU machine, 2 cores).
# BASE and AFTER are checkouts of the two commits (git worktree add); each run is its own server.
set -euo pipefail
BASE=${BASE:?checkout of the base commit}; AFTER=${AFTER:?checkout of this commit}; OUT=${OUT:-/tmp/front-direct}
run() {  # label tree [served.py args]
  local label=$1 tree=$2; shift 2
  (cd "$tree" && python benchmarks/served.py --model ouro_backend/models/ouro-demo --stand-in --concurrency 64 \
    --requests 1536 --repeats 3 --skip-perf-analyzer --engine-arg device=cpu --engine-arg num_blocks=8192 --trace \
    --out "$OUT/$label" "$@" > "$OUT/$label.log" 2>&1)
}
mkdir -p "$OUT"
run base2 "$BASE"; run front2 "$AFTER"                                                   # at the path's ceiling
run pbase "$BASE" --stand-in-round-ms 12; run pfront "$AFTER" --stand-in-round-ms 12     # at a fixed load
