#!/usr/bin/env bash
# Served throughput of several code trees on one machine, one after the other: for each NAME:DIR in VERSIONS
# (DIR a checkout or `git archive` of the package, e.g. `git archive 89b1682 ouro_backend client benchmarks
# model_repository | tar -x -C .old-front`; "." for this tree), ouro-serve on the Ouro-1.4B shape with random
# weights, then client/load.py against `ouro` (gRPC streaming, C64, 128-token prompt, 64 tokens, EOS ignored):
# a warm-up and REPEATS runs of 256 requests. Run it from the repository root with the tritonserver environment
# (on the device: `source .device-bundle/activate.sh`). JSON per run in $OUT/<run>_<name>_<k>.json.
#   VERSIONS="before:.old-front after:. before:.old-front after:." bash benchmarks/served_versions.sh
set -u
out=${OUT:-served-versions}; mkdir -p "$out"; out=$(cd "$out" && pwd)
export OURO_CACHE_DIR=${OURO_CACHE_DIR:-/tmp/ourocache} PYTHONUNBUFFERED=1
root=$PWD
M=$OURO_CACHE_DIR/ouro-1.4b
PYTHONPATH=$root python3 -c "from ouro_backend.entrypoints.bench import ensure_shape_checkpoint as e; e('ouro-1.4b')" > /dev/null
P=$(PYTHONPATH=$root python3 -c "import sys; sys.path.insert(0,'benchmarks'); from served import make_prompt; print(make_prompt('$M',128)[0])")
n=0
for v in ${VERSIONS:-after:.}; do
  n=$((n+1)); name=${v%%:*}; dir=$(cd "${v#*:}" && pwd)
  (cd "$dir" && PYTHONPATH=$dir exec python3 -m ouro_backend.entrypoints.serve --model "$M" --http-port 28000 \
     --grpc-port 28001 --metrics-port 28002 --engine-arg max_num_seqs=64 --log-file "$out/server_${n}_$name.log" \
     > "$out/serve_$n.out" 2>&1) &
  for i in $(seq 180); do curl -sf localhost:28000/v2/health/ready > /dev/null && break; sleep 1; done
  L="python3 $root/client/load.py --url localhost:28001 -c 64 --max-tokens 64 --prompt"
  $L "$P" -n 64 --json /dev/null 2>/dev/null > /dev/null
  for k in $(seq "${REPEATS:-2}"); do
    $L "$P" -n 256 --json "$out/load_${n}_${name}_$k.json" 2>&1 | grep "tok/s" | sed "s/^/$name $k: /"
  done
  pkill -INT -f "ouro_backend.entrypoints.serve --model $M"; sleep 8
done
