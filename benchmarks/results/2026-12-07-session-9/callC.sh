#!/usr/bin/env bash
# Session 2026-12-07 #9, call C (not run: no machine): call A's served C256 runs failed in engine-direct's phase
# with a CUDA error whose message was cut off (branch `mixed-rows` tree, now main). Here, on main: ouro-bench C256
# 64/64 at 256 rows (issue 30's command); the tree before the 16-row mixed graphs (.calls/main_tree, c3a488c, as
# in callD.sh) too if it fails; then served.py C256 full depth with the whole stderr kept. From the repository
# root, carrying .device-bundle.
set -u
DL=${DL:-450}
source benchmarks/device_call.sh cC
t; cat $R/host.txt
NEW=$PWD
ln -sfn $NEW/ouro_backend/models .calls/main_tree/ouro_backend/models
export PYTHONPATH=$NEW
checkpoint; t
W="--input-len 64 --output-len 64 --concurrency 256 --num-requests 1024 --workload full --engine-arg max_num_seqs=256"
bench c256_main $NEW 150 $W || bench c256_c3a488c $NEW/.calls/main_tree 150 $W
t
source .device-bundle/activate.sh > $R/activate.log 2>&1
echo "+ python3 benchmarks/served.py --concurrency 256 --requests 1024 --input-len 64 --output-len 64 --repeats 1 --skip-perf-analyzer" > $R/served_c256_full.log
[ $(left) -gt 150 ] && timeout -k 5 $(cap 200) python3 benchmarks/served.py --concurrency 256 --requests 1024 --input-len 64 --output-len 64 --repeats 1 \
  --skip-perf-analyzer --port-base 19500 --out /tmp/e_full >> $R/served_c256_full.log 2>&1; echo "served rc=$?"
mkdir -p $R/c256_full; cp /tmp/e_full/*.json /tmp/e_full/*.txt $R/c256_full/ 2>/dev/null
grep -v "^frame" $R/served_c256_full.log | tail -25 | cut -c1-300
t
