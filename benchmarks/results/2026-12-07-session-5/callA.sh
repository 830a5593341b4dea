#!/usr/bin/env bash
# Session 2026-12-07 #5, call A (issues 30 and 25), from the repository root of main ace060e with
# ../2026-12-07-prompt-work/prompt_attn_tiles.patch and 540242b's attention.py change applied to the working tree (prompt attention: whole key tiles below a q tile's first query without masks, and prompt
# launches' q tiles heaviest first with kv heads fastest), and in .calls/ the attention.py of main
# (attention_main.py), of main + the tiles patch alone (attention_tiles.py) and of main before 6e1481a
# (attention_pre.py: 128-query tiles, 8 warps, 2 stages):
#  1. the prompt-attention sweep (1 x 2,048, 16 x 128, 4 x 512 after 512 cached) on lpt / main / tiles, outputs
#     compared bitwise across the builds;
#  2. a fresh 2,048-token prompt profiled on lpt and main;
#  3. served C64 full depth with perf_analyzer's stability check (benchmarks/served.py's default now);
#  4. if time is left: the GPU kernel tests of attention with the patch, pre's profile and lpt's again, and ncu of the lpt launch against SDPA's flash kernel.
set -u
DL=${DL:-500}
source benchmarks/device_call.sh cA
t; cat $R/host.txt
NEW=$PWD
for v in main tiles pre; do  # the package with that attention.py (the only file that differs)
  rm -rf /tmp/${v}_tree; mkdir -p /tmp/${v}_tree; cp -r ouro_backend /tmp/${v}_tree/; cp .calls/attention_$v.py /tmp/${v}_tree/ouro_backend/kernels/attention.py
done
path() { case $1 in lpt*) echo $NEW;; main*) echo /tmp/main_tree:$NEW;; tiles*) echo /tmp/tiles_tree:$NEW;; pre*) echo /tmp/pre_tree:$NEW;; esac; }
for v in lpt main tiles; do
  g=m64_n64_w4_st3; [ $v = lpt ] && g=$g,m128_n64_w8_st3,m128_n128_w8_st3
  PYTHONPATH=$(path $v) timeout -k 5 $(cap 40) python3 benchmarks/kernels/prefill_attn_sweep.py --cases 1x2048+0,16x128+0,4x512+512 --replays 10 --grid $g --out $R/attn_$v.json --save-outputs /tmp/attn_out_$v.pt > $R/attn_$v.log 2>&1
  echo "== $v"; grep -vE "^\[" $R/attn_$v.log | cut -c1-150; t
done
python3 -c "
import torch; o={v: torch.load(f'/tmp/attn_out_{v}.pt') for v in ('lpt','main','tiles')}
for c in o['main']: print('bitwise', c, {v: torch.equal(o[v][c], o['main'][c]) for v in ('lpt','tiles')})" 2>&1 | tail -4
prof() {  # label
  PYTHONPATH=$(path $1) timeout -k 5 $(cap 40) python3 benchmarks/round_profile.py --prompt-tokens 2048 --out $R/prompt_$1.json > $R/prompt_$1.log 2>&1
  python3 -c "import json;d=json.load(open('$R/prompt_$1.json')); print('$1', d['wall_ms'], d['kernel_us_by_kind'].get('attention'), d.get('attention_tflops'), d['all_tflops'])" 2>&1 | tail -1; t
}
prof lpt1; prof main1
(
export PYTHONPATH=$NEW
echo "left for served: $(left)"
source .device-bundle/activate.sh > $R/activate.log 2>&1
l=stab10
timeout -k 5 $(cap 255) python3 benchmarks/served.py --concurrency 64 --requests 512 --repeats 1 --out /tmp/e_$l --port-base 19500 > $R/served_$l.log 2>&1
echo "$l rc=$? $(t)"
mkdir -p $R/$l; cp /tmp/e_$l/served_summary.json /tmp/e_$l/perf_analyzer.log $R/$l/ 2>/dev/null
cp /tmp/e_$l/perf_analyzer/ouro_c64.requests.json /tmp/e_$l/perf_analyzer/ouro_c64.log $R/$l/ 2>/dev/null
python3 benchmarks/results/2026-12-05-h200-session/pa_windows.py $R/$l/ouro_c64.requests.json > $R/$l/pa_windows.txt 2>&1
tail -6 $R/$l/pa_windows.txt | cut -c1-300
grep -E "Pass \[|stable|Throughput" $R/$l/ouro_c64.log | head -20
python3 -c "
import json;d=json.load(open('$R/$l/served_summary.json'))
print({k:v for k,v in d.items() if not isinstance(v,(dict,list)) and ('tok_s' in k or 'ratio' in k or 'flight' in k or 'depth' in k)}); print('ttft', d.get('ttft_p50_ms'))" 2>&1 | cut -c1-1200
t
)
[ "$(left)" -gt 70 ] && { PYTHONPATH=$NEW timeout -k 5 $(cap 60) python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "paged or attention or decode_launch or skip_the_mask" > $R/kernel_tests.log 2>&1; echo "kernel tests: $(tail -1 $R/kernel_tests.log)"; t; }
[ "$(left)" -gt 50 ] && { prof pre1; prof lpt2; }
if command -v ncu >/dev/null && [ "$(left)" -gt 40 ]; then
  PYTHONPATH=$NEW timeout -k 5 $(cap 90) ncu --clock-control none -k "regex:_paged_attn|flash_fwd" -c 2 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
    --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis python3 -c "
import torch
from benchmarks.kernels.prefill_attn_sweep import Case
c = Case(1, 2048, 0, layers=1)
c.call(0, {}); run, _ = c.sdpa(); run(); torch.cuda.synchronize()" > $R/ncu.txt 2>&1
  echo "ncu rc=$?"; grep -E "^  [a-z_]|Duration|Compute \(SM\) Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Warp Cycles Per Issued|Issue Slots Busy|Executed Ipc A" $R/ncu.txt | cut -c1-120 | head -40; t
fi
