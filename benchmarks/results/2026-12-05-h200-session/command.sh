#!/usr/bin/env bash
# The device calls behind this folder (one H200, run from the repository root at main 482555f), in order.
# Prepared on the CPU machine first:
#   .base: git archive d9a9149 ouro_backend benchmarks client model_repository pyproject.toml (demo model and
#          benchmarks/results removed: the 64 MiB carry limit); .tma: git archive tma-linear ouro_backend benchmarks
#          tests pyproject.toml (demo removed); .calls/shard0-2 and rest_ids: gpu_tests/ here; calls 4-5 ran with
#          ouro_backend/models/ouro-demo moved out of the tree and .device-bundle carried.
# Call 6 (perf_analyzer with the warm-up, the fix in 68f0527) was refused: too little device time was left.

# ---------------- .calls/call1.sh ----------------
# Call 1 (2026-12-05): the engine against the fp32 oracle on the GPU (tests/test_gpu.py, three shards in
# parallel: correctness only, nothing timed), the TMA branch's linear kernel tests, then the TMA configs
# tuned inside the decode loop (alone on the GPU).
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee $OUT/gpu.txt
for i in 0 1 2; do
  (PYTHONPATH=$PWD timeout 300 python3 -m pytest -q -p no:cacheprovider $(cat .calls/shard$i) > $OUT/gpu_tests_$i.log 2>&1; echo "rc=$?" >> $OUT/gpu_tests_$i.log) &
done
(cd .tma && PYTHONPATH=$PWD timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k linear > $OUT/tma_kernel_tests.log 2>&1; echo "rc=$?" >> $OUT/tma_kernel_tests.log) &
wait
for f in $OUT/gpu_tests_*.log $OUT/tma_kernel_tests.log; do echo "== $f"; grep -E "passed|failed|error|FAIL|rc=" $f | tail -6; done
echo "t=$(( $(date +%s) - T0 ))"
(cd .tma && PYTHONPATH=$PWD timeout $(( 560 - ($(date +%s) - T0) )) python3 benchmarks/kernels/loop_bench.py tune \
  --sweep benchmarks/kernels/tma_candidates.json --top 6 --rows 1,4,8,16 --out $OUT/tma_tune.json) 2>&1 | grep -v Warn > $OUT/tma_tune.log
grep "M=" $OUT/tma_tune.log; tail -3 $OUT/tma_tune.log
echo "t=$(( $(date +%s) - T0 ))"

# ---------------- .calls/call2.sh ----------------
# Call 2 (2026-12-05): why test_gpu.py's shards each stopped after one test (serial, faulthandler dumps of a
# test past 90 s), then the scheduler host change end to end: C256 64/64 full depth, base (d9a9149) then main.
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s)
PYTHONPATH=$PWD timeout 250 python3 -m pytest -v -x -p no:cacheprovider -o faulthandler_timeout=90 --durations=0 \
  $(head -3 .calls/shard0) > $OUT/gpu_diag.log 2>&1; echo "rc=$?" >> $OUT/gpu_diag.log
grep -E "PASSED|FAILED|ERROR|passed|failed|rc=|Timeout|File \"/root" $OUT/gpu_diag.log | head -60
echo "t=$(( $(date +%s) - T0 ))"
B="--shape ouro-1.4b --baseline none --input-len 64 --output-len 64 --concurrency 256 --num-requests 1024 --repeats 1 --workload full"
for side in base after; do
  d=$PWD; [ $side = base ] && d=$PWD/.base
  (cd $d && PYTHONPATH=$d timeout 130 python3 -m ouro_backend.entrypoints.bench $B --label $side --out $OUT/c256_$side.json) 2>&1 \
    | grep -v Warn | tee -a $OUT/bench.log | grep "rep \|^full"
  echo "t=$(( $(date +%s) - T0 ))"
done

# ---------------- .calls/call3.sh ----------------
# Call 3 (2026-12-05): the rest of tests/test_gpu.py, serially (call 1's parallel shards starved each other on
# one GPU; calls 1-2 passed the first five parametrizations of test_fp32_greedy_equals_oracle).
set -u
export PYTHONUNBUFFERED=1
PYTHONPATH=$PWD timeout 560 python3 -m pytest -v -p no:cacheprovider --durations=15 $(cat .calls/rest_ids) > $OUT/gpu_tests_rest.log 2>&1
echo "rc=$?" >> $OUT/gpu_tests_rest.log
grep -cE "PASSED" $OUT/gpu_tests_rest.log; grep -E "FAILED|ERROR|passed|failed|rc=" $OUT/gpu_tests_rest.log | tail -20

# ---------------- .calls/call4.sh ----------------
# Call 4 (2026-12-05): issue 25 on the H200 after the front's response building (b5e98ca) and the host-time
# changes: main at C64 full depth (engine-direct, load.py, perf_analyzer), then the base d9a9149 served alone
# (load.py, perf_analyzer), each with its own fresh server and distinct prompts. The demo model's folder is
# left out of the copy (64 MiB limit): these serve the ouro-1.4b shape.
set -u
source .device-bundle/activate.sh
export OURO_CACHE_DIR=/tmp/ourocache PYTHONUNBUFFERED=1
T0=$(date +%s)
R=$OUT/runs; mkdir -p $R
run() {  # name tree timeout args...
  name=$1; d=$2; to=$3; shift 3
  echo "+ (cd $d) python3 benchmarks/served.py $*" > $R/$name.log
  (cd $d && PYTHONPATH=$d timeout $to python3 benchmarks/served.py "$@" --out $R/$name >> $R/$name.log 2>&1) || echo "$name rc=$?" >> $R/errors.txt
  grep -E "tok/s|ratio|in_flight|ttft|TTFT|cpu" $R/$name.log | tail -12; echo "t=$(( $(date +%s) - T0 ))"
}
run after_full $PWD 290 --concurrency 64 --requests 512 --repeats 1 --port-base 19000
run base_full $PWD/.base $(( 575 - ($(date +%s) - T0) )) --concurrency 64 --requests 512 --repeats 1 --skip-direct --port-base 19100
cd $OUT && tar czf runs.tgz runs && rm -rf runs

# ---------------- .calls/call5.sh ----------------
# Call 5 (2026-12-05): as call 4 with the real gate (threshold 0.172, depth about 1.6) at C64, main then base;
# then issue 29's C16 bound: depth 1.6, 8 waves, with and without max_num_seqs=16.
set -u
source .device-bundle/activate.sh
export OURO_CACHE_DIR=/tmp/ourocache PYTHONUNBUFFERED=1
T0=$(date +%s)
R=$OUT/runs; mkdir -p $R
run() {  # name tree timeout args...
  name=$1; d=$2; to=$3; shift 3
  echo "+ (cd $d) python3 benchmarks/served.py $*" > $R/$name.log
  (cd $d && PYTHONPATH=$d timeout $to python3 benchmarks/served.py "$@" --out $R/$name >> $R/$name.log 2>&1) || echo "$name rc=$?" >> $R/errors.txt
  grep -E "tok/s|ratio|in_flight|ttft" $R/$name.log | tail -12; echo "t=$(( $(date +%s) - T0 ))"
}
run after_gate $PWD 200 --concurrency 64 --requests 512 --repeats 1 --exit-threshold 0.172 --port-base 19200
run base_gate $PWD/.base 150 --concurrency 64 --requests 512 --repeats 1 --exit-threshold 0.172 --skip-direct --port-base 19300
(cd $OUT && tar czf runs.tgz runs && rm -rf runs)
B="--shape ouro-1.4b --baseline none --input-len 128 --output-len 64 --concurrency 16 --waves 8 --repeats 1 --workload full depth=1.6 --calibration-requests 64"
for x in "" "--engine-arg max_num_seqs=16"; do
  left=$(( 470 - ($(date +%s) - T0) )); [ $left -lt 40 ] && break
  PYTHONPATH=$PWD OURO_CACHE_DIR=/tmp/ourocache timeout $left python3 -m ouro_backend.entrypoints.bench $B $x --out $OUT/c16${x:+_seqs16}.json 2>&1 | grep -v Warn | tee -a $OUT/c16.log | grep "rep \|^full\|^depth"
  echo "t=$(( $(date +%s) - T0 ))"
done

# ---------------- .calls/call6.sh ----------------
# Call 6 (2026-12-05): perf_analyzer with warm-up requests (run_perf.py's new default, 4 x C) at C64, full
# depth with engine-direct in the same run, then the gate (threshold 0.172) served only, if time is left.
set -u
source .device-bundle/activate.sh
export OURO_CACHE_DIR=/tmp/ourocache PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
T0=$(date +%s)
R=$OUT/runs; mkdir -p $R
run() {  # name timeout args...
  name=$1; to=$2; shift 2
  [ $to -lt 30 ] && return
  echo "+ python3 benchmarks/served.py $*" > $R/$name.log
  timeout $to python3 benchmarks/served.py "$@" --out $R/$name >> $R/$name.log 2>&1 || echo "$name rc=$?" >> $R/errors.txt
  grep -E "tok/s|ratio|in_flight|ttft" $R/$name.log | tail -12; echo "t=$(( $(date +%s) - T0 ))"
}
run warm_full 125 --concurrency 64 --requests 512 --repeats 1 --port-base 19400
run warm_gate $(( 185 - ($(date +%s) - T0) )) --concurrency 64 --requests 512 --repeats 1 --exit-threshold 0.172 --skip-direct --port-base 19500
(cd $OUT && tar czf runs.tgz runs && rm -rf runs)
