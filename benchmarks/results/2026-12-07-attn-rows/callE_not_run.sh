#!/usr/bin/env bash
# Session 2026-12-07, call E (issue 25): served C64 full depth, 128/64, 512 requests. Run 1: engine-direct,
# load.py and perf_analyzer with TRITON_CLIENT_GRPC_CHANNEL_MAX_SHARE_COUNT=1 (each of its contexts on its own gRPC
# channel); run 2, as time allows: load.py and perf_analyzer with the client library's default channel sharing.
# perf_analyzer's request timelines (each request's send / first / last response) come back with pa_windows.py's reading.
set -u
DL=${DL:-420}
source benchmarks/device_call.sh cE
export PYTHONPATH=$PWD
t; cat $R/host.txt
source .device-bundle/activate.sh > $R/activate.log 2>&1
PW=benchmarks/results/2026-12-05-h200-session/pa_windows.py
served() {  # label share_count extra-args...
  local l=$1 s=$2; shift 2
  [ $(left) -lt 120 ] && { echo "skip $l"; return; }
  local e=(env -u TRITON_CLIENT_GRPC_CHANNEL_MAX_SHARE_COUNT); [ $s != default ] && e=(env TRITON_CLIENT_GRPC_CHANNEL_MAX_SHARE_COUNT=$s)
  "${e[@]}" timeout -k 5 $(cap 330) python3 benchmarks/served.py --concurrency 64 --requests 512 --repeats 1 --trace --out /tmp/e_$l "$@" > $R/served_$l.log 2>&1
  echo "$l rc=$? $(t)"
  mkdir -p $R/$l; cp /tmp/e_$l/served_summary.json /tmp/e_$l/perf_analyzer.log $R/$l/ 2>/dev/null
  cp /tmp/e_$l/perf_analyzer/ouro_c64.requests.json $R/$l/ 2>/dev/null  # run_perf.py's request timeline
  python3 $PW $R/$l/ouro_c64.requests.json > $R/$l/pa_windows.txt 2>&1
  tail -6 $R/$l/pa_windows.txt | cut -c1-400
  python3 -c "
import json;d=json.load(open('$R/$l/served_summary.json'))
print({k:v for k,v in d.items() if not isinstance(v,(dict,list)) and ('tok_s' in k or 'ratio' in k or 'flight' in k or 'resp' in k)}); print('ttft', d.get('ttft_p50_ms'))" 2>&1 | cut -c1-1200
}
served share1 1 --port-base 19500
served share_default default --port-base 19600 --skip-direct
