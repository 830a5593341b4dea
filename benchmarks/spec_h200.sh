#!/usr/bin/env bash
# Issue "self-speculative decoding", on the H200: the Ouro-1.4B shape with random bf16 weights at several
# loop changes (`--loop-change`, smaller: early loops agree more with the last, so drafts are accepted more often),
# plain decoding and speculation (SPEC_ARGS) in the same call, at concurrency 1, 16 and 64, 128 in / 128 out,
# greedy, EOS ignored, random (distinct) prompts, closed loop of 2x concurrency requests, end to end;
# median of REPEATS. Results (one plain/spec pair of ouro-bench files per scale, and rows.json) go to $OUT.
#   CHANGES="0.02 0.01 0.005" SPEC_ARGS="spec_tokens=6 spec_draft_loops=1" bash benchmarks/spec_h200.sh
set -uo pipefail
out=${OUT:-spec-out}; mkdir -p "$out"; out=$(cd "$out" && pwd)
export OURO_CACHE_DIR=${OURO_CACHE_DIR:-/tmp/ourocache} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
common="--shape ouro-1.4b --concurrency ${CONCURRENCY:-1 16 64} --input-len ${INPUT_LEN:-128} --output-len ${OUTPUT_LEN:-128} --repeats ${REPEATS:-2} --baseline none"
spec=""; for a in ${SPEC_ARGS:-spec_tokens=6 spec_draft_loops=1}; do spec="$spec --engine-arg $a"; done
pairs=()
for s in ${CHANGES:-0.02 0.01 0.005}; do
  timeout 300 python3 -m ouro_backend.bench $common --loop-change "$s" --label "plain-s$s" --out "$out/plain-s$s.json" > "$out/plain-s$s.log" 2>&1
  timeout 300 python3 -m ouro_backend.bench $common --loop-change "$s" $spec --label "spec-s$s" --out "$out/spec-s$s.json" > "$out/spec-s$s.log" 2>&1
  pairs+=("$out/plain-s$s.json" "$out/spec-s$s.json")
done
python3 benchmarks/spec_rows.py "${pairs[@]}" --out "$out/rows.json"
