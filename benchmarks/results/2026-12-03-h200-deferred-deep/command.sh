#!/usr/bin/env bash
# Issue 27 (2026-12-03, main e53c312): the whole same-run matrix at one concurrency (C=64 or C=256): full depth, deferred B = 1, 4, 8, 16
# Run as `C=64 bash command.sh` (GPU test included), then `C=256 GPU=0 bash command.sh`, from the repository root.
# and the eager controls. Outputs tarred: the device returns 8 files.
set -u
T0=$(date +%s)
source .device-bundle/activate.sh
export OURO_CACHE_DIR=/tmp/ourocache PYTHONPATH=$PWD
# C64 at the default max_num_seqs=64 (mixed rounds' graphs carry every slot), C256 at max_num_seqs=256.
C=${C:-64}
R=/tmp/runs/c$C; mkdir -p $R
if [ "$C" = 64 ]; then S=64; else S=256; fi
B="python3 -m ouro_backend.entrypoints.bench --shape ouro-1.4b --baseline none --repeats 1 --input-len 128 --output-len 512 --concurrency $C --num-requests 256 --engine-arg max_num_seqs=$S"
b() { local name=$1 lim=$2; shift 2
  echo "+ $B $*" > $R/$name.log
  timeout $lim $B "$@" --out $R/$name.json >> $R/$name.log 2>&1 || echo "$name rc=$?" >> $R/errors.txt
  tar czf $OUT/runs.tgz -C $R .; echo "$name t=$(( $(date +%s) - T0 ))"; }
b full 90 --label full
b eager_b4 90 --label eager_b4 --engine-arg deferred_deep_interval=4 --engine-arg deferred_deep_eager=true
b eager_b8 90 --label eager_b8 --engine-arg deferred_deep_interval=8 --engine-arg deferred_deep_eager=true
b deferred_b4 75 --label deferred_b4 --engine-arg deferred_deep_interval=4
b deferred_b8 75 --label deferred_b8 --engine-arg deferred_deep_interval=8
b deferred_b1 90 --label deferred_b1 --engine-arg deferred_deep_interval=1
b deferred_b16 75 --label deferred_b16 --engine-arg deferred_deep_interval=16
b eager_b16 90 --label eager_b16 --engine-arg deferred_deep_interval=16 --engine-arg deferred_deep_eager=true
[ "${GPU:-1}" = 1 ] && timeout 130 python3 -m pytest -q -x tests/test_gpu.py -k deferred_deep > $R/gpu_tests.log 2>&1; echo "gpu tests rc=$?" >> $R/gpu_tests.log
tar czf $OUT/runs.tgz -C $R .; tail -3 $R/gpu_tests.log; echo "t=$(( $(date +%s) - T0 ))"
