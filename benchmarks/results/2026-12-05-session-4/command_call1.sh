#!/usr/bin/env bash
# (run as .calls/s5/*.sh on the device; the paths here point to this folder's copies)
# Issue 30: the sandwich norm inside the next projection at one row (sandwich_linear) and x read one chunk
# ahead. base = .wt-base (main before), after = the working tree; same call.
set -u
T0=$(date +%s); DL=${DL:-585}
export PYTHONUNBUFFERED=1 OURO_CACHE_DIR=/tmp/ourocache
R=$OUT/k; mkdir -p $R
t() { echo "t=$(( $(date +%s) - T0 ))"; }
left() { echo $(( DL - ($(date +%s) - T0) )); }
cap() { local a=$1 l; l=$(left); [ $a -gt $l ] && a=$l; echo $a; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/host.txt
PYTHONPATH=$PWD timeout 110 python3 -m pytest -q tests/test_kernels.py -k "linear or sandwich" -p no:cacheprovider > $R/gpu_kernel_tests.log 2>&1; echo "rc=$?" >> $R/gpu_kernel_tests.log
tail -3 $R/gpu_kernel_tests.log; t
for side in base after; do
  d=$PWD; [ $side = base ] && d=$PWD/.wt-base
  (cd $d && PYTHONPATH=$d timeout $(cap 70) python3 benchmarks/roofline.py --label $side --out $R/roofline_$side.json > $R/roofline_$side.log 2>&1; tail -2 $R/roofline_$side.log)
done; t
PYTHONPATH=$PWD timeout $(cap 60) python3 benchmarks/kernels/loop_bench.py variants --rows 1,4 --out $R/variants.json > $R/variants.log 2>&1; cat $R/variants.log | grep "M=" ; t
PYTHONPATH=$PWD timeout $(cap 130) python3 -m pytest -q -x tests/test_gpu.py -k "(greedy_equals_oracle and True and not cublas) or preemption or speculation" -p no:cacheprovider > $R/gpu_oracle_tests.log 2>&1; echo "rc=$?" >> $R/gpu_oracle_tests.log
tail -3 $R/gpu_oracle_tests.log; t
B="--shape ouro-1.4b --baseline none --input-len 128 --output-len 64"
for side in base after; do
  d=$PWD; [ $side = base ] && d=$PWD/.wt-base
  (cd $d && PYTHONPATH=$d timeout $(cap 80) python3 -m ouro_backend.entrypoints.bench $B --concurrency 1 --repeats 3 \
    --workload full depth=1.8 --label c1_$side --out $R/c1_$side.json) 2>&1 | grep -v Warn > $R/c1_$side.log; tail -4 $R/c1_$side.log
done; t
[ $(left) -gt 40 ] && PYTHONPATH=$PWD timeout $(cap 200) python3 benchmarks/kernels/loop_bench.py tune --rows 1 --top 6 \
  --sweep benchmarks/results/2026-12-05-session-4/kernels/ahead_candidates.json --out $R/tune.json > $R/tune.log 2>&1; grep "M=" $R/tune.log | tail -5; t
