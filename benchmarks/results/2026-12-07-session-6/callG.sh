#!/usr/bin/env bash
# Session 2026-12-07 #6, call G (issue 30): is sustained prompt work power-bound? ouro-bench full depth, 2,048 in /
# 64 out at C16 (64 requests), new (the packed grid in the working tree) / head (main c1ce666's attention.py in
# .calls/attention_head.py), with the SM clock, power draw and throttle reasons logged every 100 ms. Carrying .device-bundle.
set -u
DL=${DL:-240}
source benchmarks/device_call.sh cG
t; cat $R/host.txt
NEW=$PWD
rm -rf /tmp/head_tree; mkdir -p /tmp/head_tree; cp -r ouro_backend /tmp/head_tree/; cp .calls/attention_head.py /tmp/head_tree/ouro_backend/kernels/attention.py
path() { case $1 in new*) echo $NEW;; head*) echo /tmp/head_tree:$NEW;; esac; }
PYTHONPATH=$NEW timeout -k 5 $(cap 150) python3 -c "from ouro_backend.entrypoints.bench import ensure_shape_checkpoint as e; print(e('ouro-1.4b'))" > $R/checkpoint.log 2>&1; tail -1 $R/checkpoint.log; t
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,power.limit,temperature.gpu,clocks_throttle_reasons.active --format=csv -lms 100 > $R/smi.csv 2>&1 &
SMI=$!
for v in new head; do
  echo "$v start $(date +%H:%M:%S.%N)" >> $R/marks.txt
  PYTHONPATH=$(path $v) timeout -k 5 $(cap 60) python3 -m ouro_backend.entrypoints.bench --shape ouro-1.4b --baseline none --repeats 1 --workload full --input-len 2048 --output-len 64 --concurrency 16 --num-requests 64 --label $v --out $R/bench_$v.json > $R/bench_$v.log 2>&1
  echo "$v end $(date +%H:%M:%S.%N)" >> $R/marks.txt
  grep -E "INFO full" $R/bench_$v.log | tail -1 | cut -c1-160; t
done
kill $SMI
python3 - "$R" <<'PY'
import csv, sys
R = sys.argv[1]
rows = list(csv.reader(open(f"{R}/smi.csv")))[1:]
busy = [r for r in rows if len(r) > 6 and float(r[3].split()[0]) > 300]
for lo, hi in ((300, 500), (500, 650), (650, 2000)):
    sel = [r for r in busy if lo < float(r[3].split()[0]) <= hi]
    if sel:
        clk = sorted(int(r[1].split()[0]) for r in sel)
        print(f"power {lo}-{hi} W: {len(sel)} samples, SM clock median {clk[len(clk)//2]} MHz, min {clk[0]}; throttle reasons {sorted(set(r[6].strip() for r in sel))[:4]}")
PY
