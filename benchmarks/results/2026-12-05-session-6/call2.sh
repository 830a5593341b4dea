#!/usr/bin/env bash
# Issue 30: branch lm-head-skip (rebased on main 6961abf): captured rounds run the coda only when a row
# emits (CUDA graph IF node). GPU tests of the branch, then ouro-bench C1/C2/C16 full depth and gate 0.5,
# main ($PWD) vs branch (.wt-lmskip), alternating twice.
set -u
T0=$(date +%s); DL=${DL:-570}
export PYTHONUNBUFFERED=1 OURO_CACHE_DIR=/tmp/ourocache
R=$OUT/c; mkdir -p $R
t() { echo "t=$(( $(date +%s) - T0 ))"; }
left() { echo $(( DL - ($(date +%s) - T0) )); }
cap() { local a=$1 l; l=$(left); [ $a -gt $l ] && a=$l; echo $a; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/host.txt; cat $R/host.txt
python3 -c "import torch; print(torch.__version__, torch.version.cuda, hasattr(torch.cuda.CUDAGraph, 'begin_capture_to_if_node'))" | tee $R/torch.txt
W=$PWD/.wt-lmskip
(cd $W && PYTHONPATH=$W timeout 200 python3 -m pytest -q -x tests/test_gpu.py -k "coda or graph" -p no:cacheprovider) > $R/gpu_tests.log 2>&1; echo "rc=$?" >> $R/gpu_tests.log
tail -3 $R/gpu_tests.log; t
B="--shape ouro-1.4b --baseline none --input-len 128 --output-len 64 --repeats 3 --workload full threshold=0.5 --concurrency 1 2 16"
for i in 1 2; do for side in main lmskip; do
  d=$PWD; [ $side = lmskip ] && d=$W
  (cd $d && PYTHONPATH=$d timeout $(cap 90) python3 -m ouro_backend.entrypoints.bench $B --label ${side}_$i \
    --out $R/bench_${side}_$i.json) > $R/bench_${side}_$i.log 2>&1; echo "$side $i"; grep -E "^(full|thr)" $R/bench_${side}_$i.log | grep -v prompt | cut -c1-70; t
done; done
cd $OUT && tar czf c.tgz c && rm -rf c
