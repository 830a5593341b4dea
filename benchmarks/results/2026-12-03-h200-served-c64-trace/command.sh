#!/usr/bin/env bash
# Issue 25 diagnosis: C64 at the gate (depth 1.6) and full depth: direct, the engine process on its owner
# channel (--process) and served, with round and hop traces; then the gate with 4 front instances.
set -u
T0=$(date +%s)
source .device-bundle/activate.sh
export OURO_CACHE_DIR=/tmp/ourocache
nvidia-smi --query-gpu=name,memory.used --format=csv > $OUT/gpu.txt
R=$OUT/runs; mkdir -p $R
SRC=$PWD
mkdir -p /tmp/head && tar -xf base.tar -C /tmp/head && ln -sfn $SRC/ouro_backend/models /tmp/head/ouro_backend/models
cd /tmp/head; HERE=/tmp/head
export PYTHONPATH=$HERE
cp -r model_repository /tmp/repo4
sed -i 's/count: 2, kind: KIND_CPU/count: 4, kind: KIND_CPU/' /tmp/repo4/ouro/config.pbtxt
grep -n "count:" /tmp/repo4/ouro/config.pbtxt > $R/repo4.txt
run() {  # name, args...
  local name=$1; shift
  timeout 280 python3 benchmarks/served.py --concurrency 64 --requests 512 --repeats 1 --process --trace "$@" \
    --out $R/$name > $R/$name.log 2>&1 || echo "$name rc=$?" >> $R/errors.txt
  tail -30 $R/$name.log
  echo "t=$(( $(date +%s) - T0 ))"
}
run gate2 --depth 1.6 --port-base 19000
run full2 --port-base 19100 --skip-perf-analyzer
[ "${GATE4:-0}" = 1 ] && run gate4 --depth 1.6 --port-base 19200 --model-repository /tmp/repo4 --skip-perf-analyzer
tar czf $OUT/diag25.tgz -C $OUT runs && rm -rf $R
