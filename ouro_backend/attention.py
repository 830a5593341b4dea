"""Attention backends over the paged KV cache, and the per-step metadata they read.

A backend provides the handful of memory-bound ops of one Ouro layer besides the cuBLAS projections:
RMSNorm (and the fused "sandwich" epilogue), RoPE, KV writes, paged attention, SiLU*mul, and the
LAST_EXITED exit fill. `TorchBackend` is the portable reference path (CPU and GPU); the Triton-kernel
backend (`ouro_backend.kernels`) implements the same methods. Depth awareness is not the backend's
business: a row's loop plane is simply which block table the runner hands it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F


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
    cu_seqlens_q_host: Optional[list[int]] = None
    seq_lens_host: Optional[list[int]] = None
    # Rounds with prompt chunks put `decode_rows` one-query rows first. A kernel whose grid spans every
    # row for max_seqlen_q queries may run those rows apart (max_seqlen_q 1) from the prompt rows, whose
    # cu_seqlens_q relative to their first query is `cu_prefill`.
    decode_rows: int = 0
    cu_prefill: Optional[torch.Tensor] = None


class TorchBackend:
    """Plain PyTorch ops. Exact reference semantics; loops over rows for attention."""

    name = "torch"
    graph_safe = False  # attention reads host copies of the metadata

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * normed.to(x.dtype)

    def sandwich_norm(self, x: torch.Tensor, residual: torch.Tensor, w_post: torch.Tensor,
                      w_next: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Ouro's layer epilogue: residual + norm(x), then the next norm of that sum."""
        residual = residual + self.rms_norm(x, w_post, eps)
        return residual, self.rms_norm(residual, w_next, eps)

    @staticmethod
    def rope_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> None:
        """In-place split-half RoPE; cos_sin is fp32 [max_pos, head_dim] = cat(cos[:hd/2], sin[:hd/2])."""
        half = q.shape[-1] // 2
        cs = cos_sin[positions]
        cos = cs[:, None, :half].to(q.dtype)
        sin = cs[:, None, half:].to(q.dtype)
        for t in (q, k):
            x1, x2 = t[..., :half].clone(), t[..., half:].clone()
            t[..., :half] = x1 * cos - x2 * sin
            t[..., half:] = x2 * cos + x1 * sin

    def rope_and_write_kv(self, q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping) -> None:
        """RoPE on q (in place) and k, then k and v into the cache (k itself may be modified)."""
        self.rope_(q, k, positions, cos_sin)
        self.write_kv(k, v, k_cache, v_cache, slot_mapping)

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        keep = slot_mapping >= 0
        slots = slot_mapping[keep]
        k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep]
        v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep]

    @staticmethod
    def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                  scale: float) -> torch.Tensor:
        block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
        group = q.shape[1] // kv_heads
        cu = meta.cu_seqlens_q_host if meta.cu_seqlens_q_host is not None else meta.cu_seqlens_q.tolist()
        lens = meta.seq_lens_host if meta.seq_lens_host is not None else meta.seq_lens.tolist()
        out = torch.empty_like(q)
        for r, kv_len in enumerate(lens):
            qs, qe = cu[r], cu[r + 1]
            n = qe - qs
            if n == 0:
                continue
            blocks = meta.block_tables[r, : (kv_len + block_size - 1) // block_size].long()
            k = k_cache[blocks].flatten(0, 1)[:kv_len].float().repeat_interleave(group, dim=1)
            v = v_cache[blocks].flatten(0, 1)[:kv_len].float().repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q[qs:qe].float(), k) * scale
            q_pos = torch.arange(kv_len - n, kv_len, device=q.device)[:, None]
            mask = torch.arange(kv_len, device=q.device)[None, :] > q_pos
            scores.masked_fill_(mask, float("-inf"))
            out[qs:qe] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
        return out

    @staticmethod
    def copy_kv_slots(kv: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """kv: [layers, 2, blocks, block_size, kvh, hd]; copy every layer's K and V of slot src[i] to dst[i]
        (a pair with a negative slot is skipped)."""
        keep = (src >= 0) & (dst >= 0)
        flat = kv.view(kv.shape[0], kv.shape[1], -1, *kv.shape[4:])
        flat[:, :, dst[keep]] = flat[:, :, src[keep]]


def get_backend(name: str, device: torch.device, block_size: int = 16):
    """Pick the attention backend: 'auto' is our Triton kernels on CUDA (the measured path), torch elsewhere."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        return TorchBackend()
    if name == "triton":
        from .kernels.backend import TritonBackend

        return TritonBackend()
    if name == "flash":
        from .kernels.flash import FlashBackend

        return FlashBackend(device, block_size)
    raise ValueError(f"unknown attention backend {name!r}")
