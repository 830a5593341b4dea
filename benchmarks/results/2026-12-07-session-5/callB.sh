#!/usr/bin/env bash
# Session 2026-12-07 #5, call B (issue 30): prompt launches' q tiles heaviest first WITHOUT the unmasked-tiles change
# (.calls/attention_lpo.py) against main (.calls/attention_main.py): the sweep's default config, outputs compared
# bitwise; then a fresh 2,048-token prompt profiled on both if time is left.
set -u
DL=${DL:-200}
source benchmarks/device_call.sh cB
t; cat $R/host.txt
NEW=$PWD
for v in main lpo; do
  rm -rf /tmp/${v}_tree; mkdir -p /tmp/${v}_tree; cp -r ouro_backend /tmp/${v}_tree/; cp .calls/attention_$v.py /tmp/${v}_tree/ouro_backend/kernels/attention.py
done
for v in lpo main lpo2; do
  w=${v%2}
  PYTHONPATH=/tmp/${w}_tree:$NEW timeout -k 5 $(cap 40) python3 benchmarks/kernels/prefill_attn_sweep.py --cases 1x2048+0,16x128+0,4x512+512 --replays 10 --grid none --out $R/attn_$v.json --save-outputs /tmp/attn_out_$v.pt > $R/attn_$v.log 2>&1
  echo "== $v"; grep -E "default" $R/attn_$v.log | cut -c1-150; t
done
python3 -c "
import torch; o={v: torch.load(f'/tmp/attn_out_{v}.pt') for v in ('lpo','main')}
for c in o['main']: print('bitwise', c, torch.equal(o['lpo'][c], o['main'][c]), (o['lpo'][c].float()-o['main'][c].float()).abs().max().item())" 2>&1 | tail -4
python3 -c "
import torch; o={v: torch.load(f'/tmp/attn_out_{v}.pt') for v in ('lpo','main')}" >/dev/null 2>&1
export OURO_CACHE_DIR
for v in lpo main; do
  [ "$(left)" -gt 30 ] || break
  PYTHONPATH=/tmp/${v}_tree:$NEW timeout -k 5 $(cap 45) python3 benchmarks/round_profile.py --prompt-tokens 2048 --out $R/prompt_$v.json > $R/prompt_$v.log 2>&1
  python3 -c "import json;d=json.load(open('$R/prompt_$v.json')); print('$v', d['wall_ms'], d['kernel_us_by_kind'].get('attention'), d.get('attention_tflops'), d['all_tflops'])" 2>&1 | tail -1; t
done
