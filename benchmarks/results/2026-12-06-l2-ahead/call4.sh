#!/usr/bin/env bash
# Session 2026-12-06 #3, calls 4a and 4b (tree 8fd6942, the same warm H100 as call 3): decode attention at one
# row with tiles of 32 keys (8 splits, as auto_num_splits gives there) against 64, C1 full depth, A/B then
# B/A. The 32-key side patches the attention launch in the benchmark's process (the rule went into
# _attn_config after these runs). Results in call4/ (a: base, n32; b: n32b, baseb).
export PYTHONPATH=$PWD OURO_CACHE_DIR=/tmp/ourocache
B="--shape ouro-1.4b --baseline none --input-len 128 --output-len 64 --repeats 2 --workload full --concurrency 1"
n32() {
  python3 -c "
import sys
from ouro_backend.kernels import attention as A
orig = A._launch
def p(*a, **k):
    if a[7] == 1 and a[4].shape[0] == 1 and k.get('block_n') is None and a[9] is not None:
        k['block_n'] = 32
    return orig(*a, **k)
A._launch = p
from ouro_backend.entrypoints.bench import main
sys.exit(main(sys.argv[1:]))
" "$@"
}
python3 -m ouro_backend.entrypoints.bench $B --label base --out $OUT/a/base.json
n32 $B --label n32 --out $OUT/a/n32.json
n32 $B --label n32b --out $OUT/b/n32b.json
python3 -m ouro_backend.entrypoints.bench $B --label baseb --out $OUT/b/baseb.json
