"""ouro-bench with a decode KV-split rule patched in (session 2026-12-07 #7, call D), for A/B runs:
SPLIT_RULE=mixed: a mixed round's decode rows (TritonBackend.attention's first launch) get SPLITS splits of
multiples of SPLIT_GRAIN keys; SPLIT_RULE=all: every decode launch whose rows x kv heads fill the SMs (9+ rows
of 16 kv heads) gets them too (auto_num_splits gave 1); unset: the tree as it is. Runs ouro-bench with the
arguments, or a script: `splits_patch.py benchmarks/round_profile.py ARGS`."""

import os
import runpy
import sys

from ouro_backend.entrypoints.bench import main
from ouro_backend.kernels import attention as A
from ouro_backend.kernels.backend import TritonBackend

RULE, S, G = os.environ.get("SPLIT_RULE", ""), int(os.environ.get("SPLITS", "4")), int(os.environ.get("SPLIT_GRAIN", "512"))
_cfg, _auto, _attention = A._attn_config, A.auto_num_splits, TritonBackend.attention


def cfg(max_seqlen_q, G_, hd, fp32, block_m, block_n, num_warps, num_stages, num_splits=1, split_grain=None, *, rows):
    if max_seqlen_q == 1 and not fp32 and num_splits == S and split_grain is None and rows >= 9:
        split_grain = G
    return _cfg(max_seqlen_q, G_, hd, fp32, block_m, block_n, num_warps, num_stages, num_splits, split_grain, rows=rows)


def auto(num_rows, num_kv_heads, max_seqlen_q, device):
    n = _auto(num_rows, num_kv_heads, max_seqlen_q, device)
    if max_seqlen_q == 1 and device.type == "cuda" and n == 1 and num_rows >= 9:
        return S
    return n


def mixed_attention(q, k_cache, v_cache, meta, scale):
    D = meta.decode_rows
    if not D or meta.max_seqlen_q <= 1 or meta.cu_prefill is None:
        return _attention(q, k_cache, v_cache, meta, scale)
    out = A.torch.empty_like(q)
    A.paged_attention(q[:D], k_cache, v_cache, meta.cu_seqlens_q[: D + 1], meta.seq_lens[:D], meta.block_tables[:D],
                      scale, 1, out=out[:D], num_splits=S)
    A.paged_attention(q[D:], k_cache, v_cache, meta.cu_prefill, meta.seq_lens[D:], meta.block_tables[D:], scale,
                      meta.max_seqlen_q, out=out[D:])
    return out


if RULE:
    A._attn_config = cfg
    TritonBackend.attention = staticmethod(mixed_attention)
if RULE == "all":
    A.auto_num_splits = auto
print(f"split rule {RULE or 'none'}: {S} splits, grain {G}", file=sys.stderr)
if len(sys.argv) > 1 and sys.argv[1].endswith(".py"):
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
else:
    sys.exit(main())
