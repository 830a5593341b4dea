#!/usr/bin/env bash
# py-spy the ouro front stubs while served.py --stand-in runs its timed phase (CPU)
cd "$(git rev-parse --show-toplevel)" && source .venv/bin/activate && export PYTHONPATH=$PWD
rm -rf ${OUT:-/tmp/prof} && mkdir -p ${OUT:-/tmp/prof}
python benchmarks/served.py --model ouro_backend/models/ouro-demo --stand-in --concurrency 64 --requests 3000 --repeats 1 \
  --skip-perf-analyzer --engine-arg device=cpu --engine-arg num_blocks=8192 --client-processes 1 --out ${OUT:-/tmp/prof}/run > ${OUT:-/tmp/prof}/served.log 2>&1 &
SP=$!
for i in $(seq 1 300); do [ -f ${OUT:-/tmp/prof}/run/served_warmup.json ] && break; sleep 0.5; done
sleep 2
pids=$(pgrep -f "ouro/1/model.py")
echo "front stubs: $pids"
for p in $pids; do py-spy record --gil --format raw -d 8 -r 250 -p $p -o ${OUT:-/tmp/prof}/front_$p.txt --nonblocking > /dev/null 2>&1 & done
wait $SP
sleep 1; ls -la ${OUT:-/tmp/prof}
python3 "$(dirname "$0")/aggregate.py" ${OUT:-/tmp/prof}/front_*.txt
