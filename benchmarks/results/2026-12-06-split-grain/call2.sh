#!/usr/bin/env bash
# Session 2026-12-06 #4, call 2 (main dba2b66 + the tail norm + split grain, uncommitted): kernel tests; one-row
# decode attention at contexts 256/1024/4096 (default now 64-key tiles in 32-key splits, against 32-key tiles
# (dba2b66), 64-key splits and 16-key splits); the loop with the sandwich norms apart / in the tail at every row
# count / removed (probe); the decode rounds with OURO_L2_AHEAD=0/1; ouro-bench C1 tail norm (the table) against
# OURO_TAIL_NORM=0 A/B/A/B, C2 with OURO_TAIL_NORM=2 against 0, C4 with 4 KV splits against 2; the GPU tests.
set -u
DL=${DL:-585}
source benchmarks/device_call.sh c2
export PYTHONPATH=$PWD
t; cat $R/host.txt; nvidia-smi --query-compute-apps=pid,used_memory --format=csv > $R/apps_start.txt
timeout $(cap 80) python3 -m pytest -q tests/test_kernels.py -k "tail_norm or sandwich_norm or real_shapes or rope_kv_attention or split" > $R/kernel_tests.log 2>&1; tail -1 $R/kernel_tests.log; t
for c in 256 1024 4096; do
  timeout $(cap 40) python3 benchmarks/kernels/loop_bench.py variants --rows 1 --context $c --replays 30 --names attn_s8_n32,attn_s8_n64,attn_s8_n64_g16 --out $R/ctx$c.json > $R/ctx$c.log 2>&1; echo ctx=$c; cut -c1-100 $R/ctx$c.log | grep M=; t
done
timeout $(cap 100) python3 benchmarks/kernels/loop_bench.py variants --rows 1,2,4,8 --replays 30 --names tail_norm_off,tail_norm_all,probe_no_norms,l2_gate_up_0 --out $R/variants.json > $R/variants.log 2>&1; cut -c1-100 $R/variants.log | grep M=; t
for l2 in 0 1; do
  OURO_L2_AHEAD=$l2 timeout $(cap 45) python3 benchmarks/roofline.py --hbm-tb-s $HBM --label l2$l2 --out $R/roofline_l2$l2.json > $R/roofline_l2$l2.log 2>&1; python3 -c "import json;d=json.load(open('$R/roofline_l2$l2.json'));print('l2=$l2',d['decode_loop'])"; t
done
B="--shape ouro-1.4b --baseline none --input-len 128 --output-len 64 --repeats 2 --workload full"
bench() {  # label concurrency OURO_TAIL_NORM [script]
  [ $(left) -lt 30 ] && { echo "skip $1"; return; }
  OURO_TAIL_NORM=$3 timeout $(cap 45) python3 ${4:--m ouro_backend.entrypoints.bench} $B --concurrency $2 --label $1 --out $R/$1.json > $R/$1.log 2>&1
  echo "$1 $(t)"; grep -E "^full" $R/$1.log | cut -c1-60 | head -1
}
bench c1_off 1 0; bench c1_tail 1 ""; bench c1_tail_b 1 ""; bench c1_off_b 1 0
bench c2_off 2 0; bench c2_tail 2 2; bench c2_tail_b 2 2; bench c2_off_b 2 0
bench c4_base 4 ""; bench c4_s4 4 "" .calls/bench_s4.py; bench c4_s4_b 4 "" .calls/bench_s4.py; bench c4_base_b 4 ""
[ $(left) -gt 60 ] && { timeout -k 5 $(( $(left) - 10 )) python3 -m pytest -q tests/test_gpu.py -k "greedy_equals_oracle" > $R/gpu_tests.log 2>&1; tail -1 $R/gpu_tests.log; t; }
nvidia-smi --query-compute-apps=pid,used_memory --format=csv > $R/apps_end.txt
