"""Attention backends over the paged KV cache, and the per-step metadata they read.

A backend provides the handful of memory-bound ops of one Ouro layer besides the cuBLAS projections:
RMSNorm (and the fused "sandwich" epilogue), RoPE, KV writes, paged attention, SiLU*mul, and the
LAST_EXITED exit fill. `TorchBackend` is the portable reference path (CPU and GPU); the Triton-kernel
backend (`ouro_backend/kernels/backend.py`) implements the same methods. The engine picks one
(`llm_engine.attention_backend`). Depth awareness is not the backend's
business: a row's loop plane is simply which block table the runner hands it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import torch_ops


@dataclass
class AttentionMetadata:
    """Describes one recurrent round: R rows, N query tokens flattened row after row.

    Row r owns query tokens [cu_seqlens_q[r], cu_seqlens_q[r+1]); its i-th query sits at position
    seq_lens[r] - n_r + i and attends causally to KV positions 0..that position of its block table.
    """

    cu_seqlens_q: torch.Tensor  # int32 [R+1]
    seq_lens: torch.Tensor  # int32 [R]: KV length including this round's tokens
    block_tables: torch.Tensor  # int32 [R, max_blocks]
    slot_mapping: torch.Tensor  # int64 [N]: where each token's K/V is written; -1 = pad row
    max_seqlen_q: int
    max_seqlen_k: int
    # Host copies for backends that loop over rows (the torch reference path).
    cu_seqlens_q_host: list[int] | None = None
    seq_lens_host: list[int] | None = None
    # Rounds with prompt chunks put `decode_rows` one-query rows first. A kernel whose grid spans every
    # row for max_seqlen_q queries may run those rows apart (max_seqlen_q 1) from the prompt rows, whose
    # cu_seqlens_q relative to their first query is `cu_prefill`.
    decode_rows: int = 0
    cu_prefill: torch.Tensor | None = None


class TorchBackend:
    """The ops in plain torch (`torch_ops`, the kernels' twins): exact reference semantics, the CPU path.
    Attention loops over rows and reads the metadata's host copies, so it cannot be captured in a graph."""

    name = "torch"
    graph_safe = False

    rms_norm = staticmethod(torch_ops.rms_norm_ref)
    sandwich_norm = staticmethod(torch_ops.sandwich_norm_ref)
    rope_ = staticmethod(torch_ops.rope_ref)
    rope_and_write_kv = staticmethod(torch_ops.rope_and_write_kv_ref)
    silu_mul = staticmethod(torch_ops.silu_mul_ref)
    linear = staticmethod(torch_ops.linear_ref)
    mlp = staticmethod(torch_ops.mlp_ref)
    write_kv = staticmethod(torch_ops.write_kv_ref)
    copy_kv_slots = staticmethod(torch_ops.copy_kv_slots_ref)

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
        """RoPE on q (in place) and k, the KV write at ``meta.slot_mapping``, then attention."""
        torch_ops.rope_and_write_kv_ref(q, k, v, positions, cos_sin, k_cache, v_cache, meta.slot_mapping)
        return TorchBackend.attention(q, k_cache, v_cache, meta, scale)

    @staticmethod
    def attention(
        q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        return torch_ops.paged_attention_ref(
            q,
            k_cache,
            v_cache,
            meta.cu_seqlens_q,
            meta.seq_lens,
            meta.block_tables,
            scale,
            cu_host=meta.cu_seqlens_q_host,
            lens_host=meta.seq_lens_host,
        )
