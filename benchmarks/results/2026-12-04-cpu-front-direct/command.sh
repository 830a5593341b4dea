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

# tries/ (AFTER only, launches 12 ms): the `ouro` model's parameters changed in a copy of the repository
repo() {  # name sed-expression
  rm -rf "$OUT/repo_$1" && cp -r "$AFTER/model_repository" "$OUT/repo_$1" && sed -i "$2" "$OUT/repo_$1/ouro/config.pbtxt"
}
repo t4 's/key: "response_threads" value: { string_value: "" }/key: "response_threads" value: { string_value: "4" }/'
repo t2 's/key: "response_threads" value: { string_value: "" }/key: "response_threads" value: { string_value: "2" }/'
repo c1 's/key: "cancel_check_interval_s" value: { string_value: "" }/key: "cancel_check_interval_s" value: { string_value: "1.0" }/'
repo db 's/^max_batch_size: 1$/max_batch_size: 64\ndynamic_batching { }/'
run pt8 "$AFTER" --stand-in-round-ms 12; run pt8b "$AFTER" --stand-in-round-ms 12
for t in t4 t2 c1 db; do run p$t "$AFTER" --stand-in-round-ms 12 --model-repository "$OUT/repo_$t"; done

# profile_after_summary.txt: py-spy (pip install py-spy) on both `ouro` stubs for 10 s of the timed phase
(cd "$AFTER" && python benchmarks/served.py --model ouro_backend/models/ouro-demo --stand-in --stand-in-round-ms 12 \
  --concurrency 64 --requests 1536 --repeats 1 --skip-perf-analyzer --engine-arg device=cpu --engine-arg num_blocks=8192 \
  --out "$OUT/prof" > "$OUT/prof.log" 2>&1) &
until [ -f "$OUT/prof/served_warmup.json" ]; do sleep 0.5; done; sleep 3
for p in $(pgrep -f "ouro/1/model.py"); do py-spy record --gil --format raw -d 10 -r 250 -p $p -o "$OUT/front_$p.txt" --nonblocking & done
wait
python "$(dirname "$0")/../2026-12-04-cpu-front-profile/aggregate.py" "$OUT"/front_*.txt > "$OUT/profile_after_summary.txt"

# send_cost.json and tokenize_gil.json (no server of ours):
#   PYTHONPATH=$AFTER python send_cost.py --out send_cost.json;  PYTHONPATH=$AFTER python tokenize_gil.py
