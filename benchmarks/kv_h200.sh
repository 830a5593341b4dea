#!/usr/bin/env bash
# Issue "KV memory", on the H200: the Ouro-1.4B shape with random bf16 weights, through the public engine API
# (benchmarks/kv_capacity.py), this engine against the one in $OLD (an engine that reserved prompt + max_tokens
# at admission, e.g. `git archive 5d69360 ouro_backend | tar -x -C .old-engine`) in the same call.
# PARTS picks what runs (default all):
#   tests   GPU preemption tests (fp32, CUDA graphs, recompute and swap, both layouts)
#   c64     C64, 128-token prompts, max_tokens 4,096, natural stops near 256 tokens (min_tokens 192, then an
#           EOS after ~64 more): old vs new
#   prefix  C16, a shared 1K-token system prompt + 64 own tokens: prefix caching off vs on; and C64 on
#           unshared prompts, off vs on (what caching costs when nothing is shared)
#   cap1k   1K-token prompts, 512 at once (max_num_seqs 512), each generating 256 + ~64 tokens (long enough that
#           the cache, not the prefill rate, bounds how many run): the most running at once, both layouts, old vs new
# ENGINES (default "old new") picks the engines of the c64 and cap1k parts: "new" alone skips $OLD.
# Each run's JSON and log go to $OUT.
set -uo pipefail
out=${OUT:-kv-out}; mkdir -p "$out"; out=$(cd "$out" && pwd)
engines=${ENGINES:-old new}
old=${OLD:-.old-engine}; [[ $engines == *old* ]] && old=$(cd "$old" && pwd)
export OURO_CACHE_DIR=${OURO_CACHE_DIR:-/tmp/ourocache} PYTHONUNBUFFERED=1
parts=${PARTS:-tests c64 prefix cap1k}
lim=${RUN_LIMIT:-150}

run() {  # run NAME ENGINE_DIR ARGS...: one kv_capacity.py run, unless ENGINES leaves NAME's engine out
  local name=$1 engine=$2; shift 2
  case ${name##*-} in old|new) [[ " $engines " == *" ${name##*-} "* ]] || return 0 ;; esac
  echo "== $name $(date +%T)"
  PYTHONPATH=$engine timeout "$lim" python3 benchmarks/kv_capacity.py --label "$name" --out "$out/$name.json" "$@" \
    > "$out/$name.log" 2>&1
  echo "   rc=$? $(tail -c 400 "$out/$name.log" | tr '\n' ' ' | cut -c1-300)"
}

PYTHONPATH=$PWD python3 -c "from ouro_backend.entrypoints.bench import ensure_shape_checkpoint as e; e('ouro-1.4b')"
for part in $parts; do
  case $part in
    tests)
      PYTHONPATH=$PWD OURO_TEST_DEVICE=cuda timeout 300 python3 -m pytest -q tests/test_gpu.py -k preemption \
        > "$out/gpu_tests.log" 2>&1; tail -3 "$out/gpu_tests.log" ;;
    c64)
      c64="--concurrency 64 --num-requests 256 --repeats 3 --max-tokens 4096 --min-tokens 192 --eos-every 64"
      run c64-old "$old" $c64
      run c64-new "$PWD" $c64 ;;
    prefix)
      sys="--concurrency 16 --num-requests 128 --repeats 3 --shared-prefix-len 1024 --input-len 64 --max-tokens 64 --eos-every 64"
      run prefix-off "$PWD" $sys --engine-arg enable_prefix_caching=false
      run prefix-on "$PWD" $sys --engine-arg enable_prefix_caching=true
      plain="--concurrency 64 --num-requests 256 --repeats 3 --input-len 128 --max-tokens 64 --eos-every 256"
      run unshared-off "$PWD" $plain --engine-arg enable_prefix_caching=false
      run unshared-on "$PWD" $plain --engine-arg enable_prefix_caching=true ;;
    cap1k)
      lim=${RUN_LIMIT:-300}  # 512 requests living 320+ tokens each, and graphs for 512 rows
      cap="--concurrency 512 --num-requests 512 --input-len 1024 --max-tokens 4096 --min-tokens 256 --eos-every 64 --engine-arg max_num_seqs=512"
      for layout in ${LAYOUTS:-last_exited shared}; do  # one layout per device call fits its 600 s
        run "cap1k-$layout-old" "$old" $cap --engine-arg kv_layout=$layout
        run "cap1k-$layout-new" "$PWD" $cap --engine-arg kv_layout=$layout
      done ;;
  esac
done
