#!/usr/bin/env bash
# usage: bash command.sh NAME "served.py args" [NAME "args"]...
set -u
T0=$(date +%s)
source .device-bundle/activate.sh  # run with a smaller copy of the bundle (same tritonserver, perf_analyzer, wheels)
export OURO_CACHE_DIR=/tmp/ourocache PYTHONPATH=$PWD PYTHONUNBUFFERED=1
R=$OUT/runs; mkdir -p $R
port=19000
for n in 3 4; do  # model repositories with n front instances
  rm -rf /tmp/repo$n && cp -r model_repository /tmp/repo$n
  sed -i "s/instance_group \[ { count: [0-9]*, kind: KIND_CPU } \]/instance_group [ { count: $n, kind: KIND_CPU } ]/" /tmp/repo$n/ouro/config.pbtxt
  grep -q "count: $n," /tmp/repo$n/ouro/config.pbtxt || echo "repo$n: instance count not set" >> $R/errors.txt
done
while [ $# -ge 2 ]; do
  name=$1; a=$2; shift 2
  echo "+ python3 benchmarks/served.py $a" > $R/$name.log
  timeout ${STEP_TIMEOUT:-280} python3 benchmarks/served.py $a --port-base $port --out $R/$name >> $R/$name.log 2>&1 || echo "$name rc=$?" >> $R/errors.txt
  port=$((port+100))
  grep -E "tok/s|threshold|ratio|in_flight|mean_running|running" $R/$name.log | tail -12; echo "t=$(( $(date +%s) - T0 ))"
done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt
cd $OUT && tar czf runs.tgz runs && rm -rf runs

# The five device calls (each: bash command.sh NAME "served.py args" ...; results under $OUT/runs/NAME):
# 1  C="--concurrency 256 --requests 1024 --input-len 64 --output-len 64 --repeats 1 --skip-perf-analyzer --exit-threshold 0.1875 --trace"
#    c256_gate_p16 "$C"   c256_gate_p16_switch05 "$C --skip-direct --engine-arg switch_interval_ms=0.5"
#    (that call's tree had a switch_interval_ms serving option, default 5 ms = Python's; not committed)
# 2  C="--concurrency 256 --requests 1024 --input-len 64 --output-len 64 --repeats 1 --skip-perf-analyzer --trace"
#    c256_full_p16 "$C"   c256_full_p16_fronts4 "$C --skip-direct --model-repository /tmp/repo4"
#    c256_gate_p16_fronts4 "$C --skip-direct --model-repository /tmp/repo4 --exit-threshold 0.1875"
#    c64_gate_call2 "--concurrency 64 --requests 512 --repeats 1 --skip-perf-analyzer --trace --exit-threshold 0.172"
# 3  C="--concurrency 256 --requests 1024 --input-len 64 --output-len 64 --repeats 1 --skip-perf-analyzer --trace --exit-threshold 0.1875"
#    c256_gate_p16_call3 "$C"   c256_gate_p8_call3 "$C --skip-direct --client-processes 8"
#    c64_full "--concurrency 64 --requests 512 --repeats 1"
# 4  (f266fd8) C="--concurrency 256 --requests 1024 --input-len 64 --output-len 64 --repeats 1 --skip-perf-analyzer --trace"
#    c256_gate "$C --exit-threshold 0.1875"   c256_full "$C"
#    c64_gate "--concurrency 64 --requests 512 --repeats 1 --exit-threshold 0.172"
# 5  (f266fd8) c64_gate_fronts4 "--concurrency 64 --requests 512 --repeats 1 --exit-threshold 0.172 --model-repository /tmp/repo4"
#    c64_full_fronts4 "--concurrency 64 --requests 512 --repeats 1 --model-repository /tmp/repo4"
