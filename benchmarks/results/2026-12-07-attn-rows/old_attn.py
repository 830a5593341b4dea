"""Runs a script or module with decode attention's launch rules as before this session (main 8d87035): no
2-way split at 5-8 rows, 3 stages / 4 warps at every decode row count, a first tile of a whole tile.
    python3 .calls/old_attn.py -m MODULE ARGS...   |   python3 .calls/old_attn.py SCRIPT ARGS..."""

import runpy
import sys

from ouro_backend.kernels import attention as A

_cfg = A._attn_config


def old_config(*a, rows=None, **k):
    c = _cfg(*a, rows=None, **k)
    return c._replace(first_n=c.block_n)


def old_splits(programs, sms):
    if programs * 2 > sms:
        return 1
    return max(4, min(8, sms // max(programs, 1)))


A._attn_config = old_config
A.splits_for = old_splits
if sys.argv[1] == "-m":
    mod = sys.argv[2]
    sys.argv = [mod, *sys.argv[3:]]
    runpy.run_module(mod, run_name="__main__", alter_sys=True)
else:
    path = sys.argv[1]
    sys.argv = sys.argv[1:]
    runpy.run_path(path, run_name="__main__")
