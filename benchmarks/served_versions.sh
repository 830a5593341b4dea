#!/usr/bin/env bash
# benchmarks/served.py for several code trees or front settings on one machine, one after the other.
# VERSIONS is a list of NAME:DIR[:THREADS[:INSTANCES]]: DIR a checkout or a `git archive` of the package ("." for
# this tree), e.g. `git archive 89b1682 ouro_backend client benchmarks model_repository | tar -x -C .old-front`;
# THREADS and INSTANCES, when given, set the `ouro` front's response_threads and instance count in a copy of DIR's
# model repository. Each version is served
# by DIR's own ouro-serve and measured by this tree's served.py and clients; SERVED_ARGS go to every served.py
# (--skip-direct is added after the first version, which also measures engine-direct). Run it from the
# repository root with the tritonserver environment (on the device: `source .device-bundle/activate.sh`).
# Results: $OUT/NAME/ (served_summary.json and the tools' files).
#   VERSIONS="before:.old-front after:. after32:.:32 two:.::2" SERVED_ARGS="--repeats 2 --trace" bash benchmarks/served_versions.sh
set -eu
out=${OUT:-served-versions}; mkdir -p "$out"; out=$(cd "$out" && pwd)
export OURO_CACHE_DIR=${OURO_CACHE_DIR:-/tmp/ourocache} PYTHONUNBUFFERED=1
root=$PWD
skip=""
for v in ${VERSIONS:-this:.}; do
  IFS=: read -r name dir threads instances <<< "$v"
  dir=$(cd "$dir" && pwd)
  mkdir -p "$out/$name"
  repo="$out/$name/model_repository"
  rm -rf "$repo" && cp -r "$dir/model_repository" "$repo"
  if [ -n "${threads:-}" ]; then
    sed -i "s/key: \"response_threads\" value: { string_value: \"[0-9]*\" }/key: \"response_threads\" value: { string_value: \"$threads\" }/" \
      "$repo/ouro/config.pbtxt"
    grep -q "string_value: \"$threads\"" "$repo/ouro/config.pbtxt"
  fi
  if [ -n "${instances:-}" ]; then
    sed -i "s/instance_group \[ { count: [0-9]*, kind: KIND_CPU } \]/instance_group [ { count: $instances, kind: KIND_CPU } ]/" \
      "$repo/ouro/config.pbtxt"
    grep -q "count: $instances," "$repo/ouro/config.pbtxt"
  fi
  echo "== $name: $dir${threads:+, response_threads=$threads}${instances:+, $instances instances}"
  # ouro-serve runs from DIR (cwd and PYTHONPATH), so DIR's package serves; served.py itself is this tree's.
  (cd "$dir" && PYTHONPATH=$dir python3 "$root/benchmarks/served.py" --model-repository "$repo" --out "$out/$name" \
     $skip ${SERVED_ARGS:-}) > "$out/$name/served.log" 2>&1 || echo "$name failed: see $out/$name/served.log"
  tail -n 25 "$out/$name/served.log"
  skip="--skip-direct"
done
