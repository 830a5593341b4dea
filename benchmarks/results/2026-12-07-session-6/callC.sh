#!/usr/bin/env bash
# Prepared in session 2026-12-07 #5 (`../2026-12-07-session-5/callC_not_run.sh`), run in session #6 with every attention group printed. From the repository root of main, with the
# attention.py before 540242b in .calls/attention_pre.py (`mkdir -p .calls && git show 540242b^:ouro_backend/kernels/attention.py
# > .calls/attention_pre.py`), carrying .device-bundle:
#  1. the random 1.4B checkpoint generated first, outside any profile's cap (session 5's first profiles timed out on it);
#  2. a fresh 2,048-token prompt profiled on main and on main before 540242b (heavy-first prompt attention), A/B/A/B,
#     with the attention launches split by grid (`attention_launches`);
#  3. the gated C64 served run with engine-direct on the same prompts (served.py's --direct-prompts served default).
set -u
DL=${DL:-590}
source benchmarks/device_call.sh cC
t; cat $R/host.txt
NEW=$PWD
rm -rf /tmp/pre_tree; mkdir -p /tmp/pre_tree; cp -r ouro_backend /tmp/pre_tree/; cp .calls/attention_pre.py /tmp/pre_tree/ouro_backend/kernels/attention.py
PYTHONPATH=$NEW timeout -k 5 $(cap 150) python3 -c "from ouro_backend.entrypoints.bench import ensure_shape_checkpoint as e; print(e('ouro-1.4b'))" > $R/checkpoint.log 2>&1; tail -1 $R/checkpoint.log; t
prof() {  # label pythonpath
  PYTHONPATH=$2 timeout -k 5 $(cap 60) python3 benchmarks/round_profile.py --prompt-tokens 2048 --out $R/prompt_$1.json > $R/prompt_$1.log 2>&1
  python3 -c "
import json; d=json.load(open('$R/prompt_$1.json'))
print('$1', d['wall_ms'], d['kernel_us_by_kind'].get('attention'), d['all_tflops'], [(g['grid'], g['launches'], g['median_us']) for g in d['attention_launches']])" 2>&1 | tail -1; t
}
prof main1 $NEW; prof pre1 /tmp/pre_tree:$NEW; prof main2 $NEW; prof pre2 /tmp/pre_tree:$NEW
(
export PYTHONPATH=$NEW
source .device-bundle/activate.sh > $R/activate.log 2>&1
l=gate
timeout -k 5 $(cap 300) python3 benchmarks/served.py --concurrency 64 --requests 512 --repeats 1 --exit-threshold 0.172 --out /tmp/e_$l --port-base 19500 > $R/served_$l.log 2>&1
echo "$l rc=$? $(t)"
mkdir -p $R/$l; cp /tmp/e_$l/served_summary.json /tmp/e_$l/perf_analyzer/ouro_c64.requests.json $R/$l/ 2>/dev/null
python3 -c "
import json;d=json.load(open('$R/$l/served_summary.json'))
print({k:v for k,v in d.items() if not isinstance(v,(dict,list)) and ('tok_s' in k or 'ratio' in k or 'depth' in k)}); print('ttft', d.get('ttft_p50_ms'))" 2>&1 | cut -c1-1200
)
t
