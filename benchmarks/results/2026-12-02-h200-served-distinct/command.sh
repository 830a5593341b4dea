#!/usr/bin/env bash
# 1. the serving path alone (stand-in engine), 256 streams: the base tree (c74da94) and this tree
# 2. served vs engine-direct, C64, full depth and the gate (threshold 0.5): this tree
set -u
T0=$(date +%s)
source .device-bundle/activate.sh
export OURO_CACHE_DIR=/tmp/ourocache
nvidia-smi --query-gpu=name,memory.used --format=csv > $OUT/gpu.txt
R=$OUT/runs; mkdir -p $R
HERE=$PWD
mkdir -p /tmp/base && tar -xf base.tar -C /tmp/base && ln -sfn $HERE/ouro_backend/models /tmp/base/ouro_backend/models
cp -r .device-bundle /tmp/base/ 2>/dev/null
SI="--model $HERE/ouro_backend/models/ouro-demo --stand-in --concurrency 256 --requests 1024 --repeats 2 --skip-perf-analyzer --engine-arg device=cpu --engine-arg num_blocks=16384"
for tree in base:/tmp/base after:$HERE; do
  n=${tree%%:*}; d=${tree##*:}
  (cd $d && PYTHONPATH=$d timeout 100 python3 benchmarks/served.py $SI --port-base 19000 --out $R/standin-$n > $R/standin-$n.log 2>&1) || echo "standin-$n rc=$?" >> $R/errors.txt
  grep -E '"(served_output_tok_s|served_responses_per_s|served_ttft_p50_s|served_repeats)"' -A2 $R/standin-$n/served_summary.json | head -12
  echo "t=$(( $(date +%s) - T0 ))"
done
export PYTHONPATH=$HERE
for w in full:1.0 gate:0.5; do
  name=${w%%:*}; thr=${w##*:}
  timeout 200 python3 benchmarks/served.py --concurrency 64 --requests 512 --repeats 3 --exit-threshold $thr \
    --out $R/c64-$name > $R/c64-$name.log 2>&1 || echo "c64-$name rc=$?" >> $R/errors.txt
  tail -42 $R/c64-$name.log
  echo "t=$(( $(date +%s) - T0 ))"
done
tar czf $OUT/served1.tgz -C $OUT runs && rm -rf $R
