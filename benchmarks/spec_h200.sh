#!/usr/bin/env bash
# Issue "self-speculative decoding", on the H200: the Ouro-1.4B shape with random bf16 weights at several
# loop changes (`--loop-change`, smaller: early loops agree more with the last, so drafts are accepted more often),
# plain decoding and speculation in the same call, at each concurrency, greedy, random (distinct) prompts,
# end to end; median of REPEATS. Closed loop of 2x concurrency requests at fixed lengths (EOS ignored) unless
# EXTRA says otherwise (e.g. EXTRA="--arrival-rate 8 --natural-eos --eos-every 128": Poisson arrivals, each
# request stopping at its own EOS). SPEC_SETS: speculative configurations, each KEY=VALUE[,KEY=VALUE...].
# Results (one plain and one file per spec set and loop change, ouro-bench's JSON and log, and rows.json) go to $OUT.
#   CHANGES="0.05 0.025 0.012" SPEC_SETS="spec_tokens=3,spec_draft_loops=1 spec_tokens=6,spec_draft_loops=1" \
#     bash benchmarks/spec_h200.sh
set -uo pipefail
out=${OUT:-spec-out}; mkdir -p "$out"; out=$(cd "$out" && pwd)
tag=${TAG:-}
export OURO_CACHE_DIR=${OURO_CACHE_DIR:-/tmp/ourocache} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
common="--shape ouro-1.4b --concurrency ${CONCURRENCY:-1 16 64} --input-len ${INPUT_LEN:-128} --output-len ${OUTPUT_LEN:-128} --repeats ${REPEATS:-2} --baseline none ${EXTRA:-}"
pairs=()
for s in ${CHANGES:-0.05 0.025 0.012}; do
  plain="$out/${tag}plain-s$s"
  timeout 300 python3 -m ouro_backend.entrypoints.bench $common --loop-change "$s" --label "plain-s$s" --out "$plain.json" > "$plain.log" 2>&1
  for set in ${SPEC_SETS:-spec_tokens=6,spec_draft_loops=1}; do
    spec=""; name=""
    for a in ${set//,/ }; do
      spec="$spec --engine-arg $a"; name="$name$(echo "$a" | sed 's/^spec_tokens=/K/; s/^spec_draft_loops=/d/; s/=//')"
    done
    f="$out/${tag}spec-${name}-s$s"
    timeout 300 python3 -m ouro_backend.entrypoints.bench $common --loop-change "$s" $spec --label "spec-$name-s$s" --out "$f.json" > "$f.log" 2>&1
    pairs+=("$plain.json" "$f.json")
  done
done
python3 benchmarks/spec_rows.py "${pairs[@]}" --out "$out/${tag}rows.json"
