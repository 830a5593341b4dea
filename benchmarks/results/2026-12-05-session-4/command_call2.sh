#!/usr/bin/env bash
# (run as .calls/s5/*.sh on the device; the paths here point to this folder's copies)
# (1) ncu of the one-row projection kernels (memory throughput, stalls, occupancy); (2) mixed-rows hang
# diagnosis; (3) issue 25 C64 gate 0.172 --trace through tritonserver (served.py, perf_analyzer warm-up).
set -u
T0=$(date +%s); DL=${DL:-585}
pack() { (cd $OUT && tar czf runs.tgz runs); }
export PYTHONUNBUFFERED=1 OURO_CACHE_DIR=/tmp/ourocache
R=$OUT/runs; mkdir -p $R
t() { echo "t=$(( $(date +%s) - T0 ))"; }
left() { echo $(( DL - ($(date +%s) - T0) )); }
cap() { local a=$1 l; l=$(left); [ $a -gt $l ] && a=$l; echo $a; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/host.txt; nproc >> $R/host.txt
PYTHONPATH=$PWD timeout 100 ncu --clock-control none -k regex:_linear_kernel --launch-skip 8 --launch-count 4 \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats \
  python3 benchmarks/results/2026-12-05-session-4/kernels/ncu_proj.py > $R/ncu_proj.txt 2>&1; echo "rc=$?" >> $R/ncu_proj.txt
grep -E "_linear_kernel|Memory Throughput|DRAM Throughput|Duration|Achieved Occupancy|Registers Per|Stall Long|Warp Cycles Per Issued|rc=" $R/ncu_proj.txt | head -60; t; pack
D=$PWD/.wt-mixed-rows
(cd $D && PYTHONPATH=$D timeout $(cap 90) python3 $OLDPWD/benchmarks/results/2026-12-05-session-4/mixed_rows/mixed_diag.py last_exited > $R/diag.log 2>&1; echo "rc=$?" >> $R/diag.log)
tail -c 1200 $R/diag.log; t; pack
if ! grep -q "finished 24 of 24" $R/diag.log; then
  (cd $D && CUDA_LAUNCH_BLOCKING=1 PYTHONPATH=$D timeout $(cap 60) python3 $OLDPWD/benchmarks/results/2026-12-05-session-4/mixed_rows/mixed_diag.py last_exited > $R/diag_blocking.log 2>&1; echo "rc=$?" >> $R/diag_blocking.log)
  tail -c 2000 $R/diag_blocking.log; t; pack
fi
source .device-bundle/activate.sh
export PYTHONPATH=$PWD
to=$(cap 300)
if [ $to -gt 120 ]; then
  echo "+ python3 benchmarks/served.py --concurrency 64 --requests 512 --repeats 1 --exit-threshold 0.172 --trace" > $R/gate_c64.log
  timeout $to python3 benchmarks/served.py --concurrency 64 --requests 512 --repeats 1 --exit-threshold 0.172 --trace \
    --port-base 19500 --out $R/gate_c64 >> $R/gate_c64.log 2>&1 || echo "gate_c64 rc=$?" >> $R/errors.txt
  grep -E "tok_s|ratio|ttft|\"served\"|\"direct\"" $R/gate_c64.log | tail -14
fi
t; pack && rm -rf $R
