#!/usr/bin/env bash
# Issue 25: branch front-batching (ouro: max_batch_size 64 + dynamic batching) against main, C64 512 requests
# through tritonserver, full depth (with perf_analyzer) then gate 0.172 (without), alternating sides;
# the inbound hop by burst (benchmarks/request_bursts.py) for each. Engine-direct runs on main's side only.
set -u
T0=$(date +%s); DL=${DL:-570}
export PYTHONUNBUFFERED=1 OURO_CACHE_DIR=/tmp/ourocache
R=$OUT/s; mkdir -p $R
t() { echo "t=$(( $(date +%s) - T0 ))"; }
left() { echo $(( DL - ($(date +%s) - T0) )); }
source .device-bundle/activate.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/host.txt; cat $R/host.txt
W=/tmp/front; mkdir -p $W && cp -r ouro_backend benchmarks model_repository client pyproject.toml $W/ && cp -r .wt-front/* $W/  # main + the branch's two changed files
port=19500
for wl in full gate; do for side in main front; do
  [ $(left) -lt 100 ] && { echo "skip $wl $side"; continue; }
  d=$PWD; [ $side = front ] && d=$W
  extra="--skip-perf-analyzer"; [ $wl = full ] && extra=""
  [ $wl = gate ] && extra="$extra --exit-threshold 0.172"
  [ $side = front ] && extra="$extra --skip-direct"  # the engine is the same on both sides: main's direct run serves both
  port=$((port + 100))
  (cd $d && PYTHONPATH=$d timeout $(( $(left) - 10 )) python3 benchmarks/served.py --concurrency 64 --requests 512 --repeats 1 \
     --trace --port-base $port --model-repository $d/model_repository $extra --out $R/${wl}_$side) > $R/${wl}_$side.log 2>&1
  echo "$wl $side rc=$?"; (cd $d && PYTHONPATH=$d python3 benchmarks/request_bursts.py $R/${wl}_$side/request_trace > $R/${wl}_$side/inbound_bursts.txt 2>&1)
  python3 -c "
import json,sys; d=json.load(open('$R/${wl}_$side/served_summary.json'))
print({k: (round(v,3) if isinstance(v,float) else v) for k,v in d.items() if any(s in k for s in ('tok_s','ratio','ttft','depth'))})" 2>&1 | cut -c1-400
  t
done; done
cd $OUT && tar czf s.tgz s && rm -rf s
