#!/usr/bin/env bash
# Session 2026-12-07 #4, call 1: a 2,048-token prompt chunk profiled by kernel kind, the projections at a mixed
# round's rows (192, 576) against cuBLAS, prompt attention's configs against SDPA (issues 29/30), the owed GPU oracle tests (fused coda under ouro_delayed), then issue 25's
# perf_analyzer channel-sharing A/B at C64 full depth (callE of benchmarks/results/2026-12-07-attn-rows/).
set -u
DL=${DL:-455}
source benchmarks/device_call.sh c1
export PYTHONPATH=$PWD
t; cat $R/host.txt
timeout -k 5 $(cap 70) python3 benchmarks/round_profile.py --prompt-tokens 2048 --out $R/prompt_profile.json > $R/prompt_profile.log 2>&1
python3 -c "
import json;d=json.load(open('$R/prompt_profile.json')); print({k:v for k,v in d.items() if k!='top_kernels_us'})
for k,v in list(d['top_kernels_us'].items())[:14]: print('  ',v,k)" 2>&1 | cut -c1-300; t
timeout -k 5 $(cap 170) python3 benchmarks/kernels/linear_bench.py --ms 128,192,320,576 --replays 10 --out $R/linear_mixed.json > $R/linear_mixed.log 2>&1
grep -E "cublas|stack" $R/linear_mixed.log | cut -c1-170; t
timeout -k 5 $(cap 100) python3 benchmarks/kernels/prefill_attn_sweep.py --cases 1x2048+0,16x128+0 --replays 10 --out $R/prefill_attn.json > $R/prefill_attn.log 2>&1
grep -E "default|torch_sdpa|fastest" $R/prefill_attn.log | cut -c1-160; t
timeout -k 5 $(cap 60) python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "row_block or linear_matches or glu" > $R/kernel_tests.log 2>&1; echo "kernel tests: $(tail -1 $R/kernel_tests.log)"; t
timeout -k 5 $(cap 110) python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "fused_greedy_coda and ouro_delayed" > $R/gpu_tests.log 2>&1; tail -1 $R/gpu_tests.log; grep -E "^FAILED" $R/gpu_tests.log | head; t
source .device-bundle/activate.sh > $R/activate.log 2>&1
PW=benchmarks/results/2026-12-05-h200-session/pa_windows.py
served() {  # label share_count capsecs extra-args...
  local l=$1 s=$2 c=$3; shift 3
  [ $(left) -lt 120 ] && { echo "skip $l"; return; }
  local e=(env -u TRITON_CLIENT_GRPC_CHANNEL_MAX_SHARE_COUNT); [ $s != default ] && e=(env TRITON_CLIENT_GRPC_CHANNEL_MAX_SHARE_COUNT=$s)
  "${e[@]}" timeout -k 5 $(cap $c) python3 benchmarks/served.py --concurrency 64 --requests 512 --repeats 1 --out /tmp/e_$l "$@" > $R/served_$l.log 2>&1
  echo "$l rc=$? $(t)"
  mkdir -p $R/$l; cp /tmp/e_$l/served_summary.json /tmp/e_$l/perf_analyzer.log $R/$l/ 2>/dev/null
  cp /tmp/e_$l/perf_analyzer/ouro_c64.requests.json $R/$l/ 2>/dev/null
  python3 $PW $R/$l/ouro_c64.requests.json > $R/$l/pa_windows.txt 2>&1
  tail -6 $R/$l/pa_windows.txt | cut -c1-400
  python3 -c "
import json;d=json.load(open('$R/$l/served_summary.json'))
print({k:v for k,v in d.items() if not isinstance(v,(dict,list)) and ('tok_s' in k or 'ratio' in k or 'flight' in k or 'resp' in k)}); print('ttft', d.get('ttft_p50_ms'))" 2>&1 | cut -c1-1200
}
served share1 1 300 --port-base 19500
served share_default default 200 --port-base 19600 --skip-direct
t
