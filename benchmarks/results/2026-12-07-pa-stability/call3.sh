#!/usr/bin/env bash
# Session 2026-12-07 #4, call 3 (issue 25): served C64 full depth with perf_analyzer's own stability check
# (benchmarks/served.py's new default: run_perf.py --stability-percentage 10 --max-trials 10), direct in the same run.
set -u
DL=${DL:-280}
source benchmarks/device_call.sh c3
export PYTHONPATH=$PWD
t; cat $R/host.txt
source .device-bundle/activate.sh > $R/activate.log 2>&1
PW=benchmarks/results/2026-12-05-h200-session/pa_windows.py
l=stab10
timeout -k 5 $(cap 260) python3 benchmarks/served.py --concurrency 64 --requests 512 --repeats 1 --out /tmp/e_$l --port-base 19500 > $R/served_$l.log 2>&1
echo "$l rc=$? $(t)"
mkdir -p $R/$l; cp /tmp/e_$l/served_summary.json /tmp/e_$l/perf_analyzer.log $R/$l/ 2>/dev/null
cp /tmp/e_$l/perf_analyzer/ouro_c64.requests.json /tmp/e_$l/perf_analyzer/ouro_c64.log $R/$l/ 2>/dev/null
python3 $PW $R/$l/ouro_c64.requests.json > $R/$l/pa_windows.txt 2>&1
tail -6 $R/$l/pa_windows.txt | cut -c1-300
grep -E "Pass \[|stable|Throughput" $R/$l/ouro_c64.log | head -20
python3 -c "
import json;d=json.load(open('$R/$l/served_summary.json'))
print({k:v for k,v in d.items() if not isinstance(v,(dict,list)) and ('tok_s' in k or 'ratio' in k or 'flight' in k)}); print('ttft', d.get('ttft_p50_ms'))" 2>&1 | cut -c1-1200
t
