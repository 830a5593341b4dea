"""The Triton-kernel attention backend: same methods as `attention.TorchBackend`, fused GPU kernels."""

from __future__ import annotations

import torch

from ..model.attention import AttentionMetadata
from . import (
    coda,
    copy_kv_slots,
    linear,
    mlp,
    paged_attention,
    rms_norm,
    rope_,
    rope_and_write_kv,
    rope_kv_attention,
    sandwich_norm,
    silu_mul,
    write_kv,
)

# Beyond this many decode rows the fused kernel is slower than RoPE + KV write then attention: its split that
# holds the new position adds it after its tiles, with more registers live through the KV loop
# (docs/engine.md, "Measurements behind the design").
FUSED_ROPE_MAX_ROWS = 16


class TritonBackend:
    name = "triton"
    graph_safe = True  # no host reads of device metadata: rounds can be captured in CUDA graphs

    rms_norm = staticmethod(rms_norm)
    sandwich_norm = staticmethod(sandwich_norm)
    rope_ = staticmethod(rope_)
    rope_and_write_kv = staticmethod(rope_and_write_kv)
    silu_mul = staticmethod(silu_mul)
    linear = staticmethod(linear)
    mlp = staticmethod(mlp)
    write_kv = staticmethod(write_kv)
    copy_kv_slots = staticmethod(copy_kv_slots)
    # The greedy coda in one kernel, run only when a row exits (`coda.py`); off with OURO_FUSED_CODA=0.
    greedy_coda = staticmethod(coda.greedy_coda) if coda.fused_coda_enabled() else None
    fused_coda_max_rows = coda.FUSED_CODA_MAX_ROWS

    @staticmethod
    def rope_kv_attention(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """RoPE, the KV write and attention; decode rounds (one query a row) of up to FUSED_ROPE_MAX_ROWS rows
        in one kernel (`rope_kv_attention`), others as two. NOTE the model calls this right after the qkv
        projection, which writes none of the caches or metadata: the fused kernel may read them before its
        PDL wait (``prefetch_kv``)."""
        if meta.max_seqlen_q == 1 and q.shape[0] == meta.seq_lens.shape[0] <= FUSED_ROPE_MAX_ROWS:
            return rope_kv_attention(
                q, k, v, positions, cos_sin, k_cache, v_cache, meta.slot_mapping, meta.cu_seqlens_q,
                meta.seq_lens, meta.block_tables, scale, prefetch_kv=True,
            )  # fmt: skip
        return TritonBackend.rope_then_attention(q, k, v, positions, cos_sin, k_cache, v_cache, meta, scale)

    @staticmethod
    def rope_then_attention(q, k, v, positions, cos_sin, k_cache, v_cache, meta, scale) -> torch.Tensor:
        """The same as two kernels: RoPE + the KV write (q rotated in place), then attention."""
        rope_and_write_kv(q, k, v, positions, cos_sin, k_cache, v_cache, meta.slot_mapping)
        return TritonBackend.attention(q, k_cache, v_cache, meta, scale)

    @staticmethod
    def attention(
        q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        D = meta.decode_rows
        if not D or meta.max_seqlen_q <= 1 or meta.cu_prefill is None:
            return paged_attention(
                q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, scale, meta.max_seqlen_q
            )
        # The grid is (query tiles of max_seqlen_q) x heads x rows: the one-query decode rows of a round
        # with prompt chunks would each get max_seqlen_q's tiles, nearly all of them empty.
        out = torch.empty_like(q)
        paged_attention(
            q[:D],
            k_cache,
            v_cache,
            meta.cu_seqlens_q[: D + 1],
            meta.seq_lens[:D],
            meta.block_tables[:D],
            scale,
            1,
            out=out[:D],
        )
        paged_attention(
            q[D:],
            k_cache,
            v_cache,
            meta.cu_prefill,
            meta.seq_lens[D:],
            meta.block_tables[D:],
            scale,
            meta.max_seqlen_q,
            out=out[D:],
        )
        return out
