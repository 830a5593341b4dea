#!/usr/bin/env bash
# Session 2026-12-06 #2, call 1: loop probes (norms / attention launch nothing), gate/up at 2-8 rows on the
# kernel with GLU (loop tune), and ouro-bench with the tune's choices against the table at C2/C4/C8.
set -u
DL=${DL:-570}
source benchmarks/device_call.sh c1
export PYTHONPATH=$PWD
t; cat $R/host.txt
timeout $(cap 170) python3 benchmarks/kernels/loop_bench.py variants --rows 1,2,4,8,16,64 --replays 30 --out $R/variants.json > $R/variants.log 2>&1; cut -c1-150 $R/variants.log | grep M=; t
timeout $(cap 260) python3 benchmarks/kernels/loop_bench.py tune --rows 2,4,8 --replays 30 --top 6 --sweep .calls/cand_glu.json --out $R/tune.json > $R/tune.log 2>&1; cut -c1-300 $R/tune.log | grep "M="; t
B="--shape ouro-1.4b --baseline none --input-len 128 --output-len 64 --repeats 2 --workload full --concurrency 2 4 8"
for side in table tune table2 tune2; do
  [ $(left) -lt 60 ] && { echo "skip $side"; continue; }
  if [[ $side == tune* ]]; then cmd="benchmarks/kernels/bench_with_tune.py $R/tune.json"; else cmd="-m ouro_backend.entrypoints.bench"; fi
  timeout $(cap 75) python3 $cmd $B --label $side --out $R/bench_$side.json > $R/bench_$side.log 2>&1; echo "$side $(t)"; grep -E "^(full|thr)" $R/bench_$side.log | cut -c1-100 | head -4
done
