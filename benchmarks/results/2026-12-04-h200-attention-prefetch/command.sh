#!/usr/bin/env bash
# The two device calls behind this folder (one H200, from the repository root, 2026-12-04). "base" is main
# at c2eb78e (`git archive HEAD ouro_backend benchmarks/roofline.py benchmarks/graph_timing.py` into .base,
# carried); "after" is the working tree with the attention change of this commit. The ahead=2 tune ran with
# ahead2.patch applied in the working tree of call 1 as well (the patch is not in main).
set -u
export PYTHONUNBUFFERED=1
R=benchmarks/results/2026-12-04-h200-attention-prefetch

# call 1
(PYTHONPATH=$PWD timeout 120 python3 -m pytest -q tests/test_kernels.py -k "linear or attention or rope" 2>&1 | tail -4) | tee $OUT/gpu_tests.log
for side in base after; do
  d=$PWD; [ $side = base ] && d=$PWD/.base
  (cd $d && PYTHONPATH=$d timeout 100 python3 benchmarks/roofline.py --label $side --out $OUT/roofline_$side.json 2>&1 | tail -3)
done
PYTHONPATH=$PWD timeout 330 python3 benchmarks/kernels/loop_bench.py tune --sweep $R/candidates_ahead2.json --top 5 \
  --rows 1,2,4 --out $OUT/loop_tune.json 2>&1 | grep -v Warn | tee $OUT/loop_tune.log

# call 2
PYTHONPATH=$PWD timeout 330 python3 $R/attn_sweep.py $OUT/attn_sweep.json 2>&1 | grep -v Warn | tee $OUT/attn_sweep.log
B="--shape ouro-1.4b --baseline none --input-len 128 --output-len 64"
for side in base after; do
  d=$PWD; [ $side = base ] && d=$PWD/.base
  (cd $d && PYTHONPATH=$d timeout 100 python3 -m ouro_backend.entrypoints.bench $B --concurrency 1 --repeats 3 \
    --workload full --label $side --out $OUT/c1_$side.json) 2>&1 | grep -v Warn | tee -a $OUT/bench.log | grep "rep \|^full"
done
for side in base after; do
  d=$PWD; [ $side = base ] && d=$PWD/.base
  (cd $d && PYTHONPATH=$d timeout 120 python3 -m ouro_backend.entrypoints.bench $B --concurrency 64 --num-requests 512 \
    --repeats 1 --workload full --label $side --out $OUT/c64_$side.json) 2>&1 | grep -v Warn | tee -a $OUT/bench.log | grep "rep \|^full"
done

# call 3, lost: the machine stopped answering during it and loans were then paused for the session
# PYTHONPATH=$PWD timeout 560 python3 -m pytest -q -x tests/test_gpu.py
