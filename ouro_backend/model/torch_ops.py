"""The memory-bound ops of one Ouro layer in plain torch: the CPU path (`attention.TorchBackend` is made of
them) and the twin each Triton kernel in `ouro_backend/kernels/` falls back to and is tested against.

One copy of each op, so the CPU engine and the kernels' references cannot drift apart. (The dense oracle,
`oracle.py`, keeps its own independent math on purpose: it is what these are checked against.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Ouro's RMSNorm exactly as the HF module computes it (output cast to x.dtype)."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * normed).to(x.dtype)


def sandwich_norm_ref(x, residual, w_post, w_next, eps) -> tuple[torch.Tensor, torch.Tensor]:
    """``new_residual = residual + rms_norm(x, w_post)``; ``y = rms_norm(new_residual, w_next)``."""
    new_residual = residual + rms_norm_ref(x, w_post, eps)
    return new_residual, rms_norm_ref(new_residual, w_next, eps)


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    I = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :I]) * gate_up[..., I:]


def linear_ref(
    x: torch.Tensor, w: torch.Tensor, silu_x: bool = False, glu: bool = False, next_weight: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ w.T``; with ``silu_x``, x is a gate/up output and the product is ``silu_mul(x) @ w.T``; with
    ``glu``, w is a gate/up weight and the result is ``silu_mul(x @ w.T)``: twin of `kernels.linear`
    (``next_weight``, the kernel's L2 prefetch, changes no value)."""
    y = (silu_mul_ref(x) if silu_x else x) @ w.t()
    return silu_mul_ref(y) if glu else y


def mlp_ref(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The MLP ``silu_mul(x @ gate_up.T) @ down.T``: twin of `kernels.mlp`."""
    return linear_ref(linear_ref(x, gate_up, glu=True), down)


def greedy_coda_ref(h: torch.Tensor, lm_head: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's greedy token of ``logits = h @ lm_head.T`` (in h's dtype, as the model's coda) and its
    logprob: twin of `kernels.coda.greedy_coda` for rounds where a row emits."""
    logits = (h @ lm_head.t()).float()
    tok = logits.argmax(-1)
    return tok, torch.log_softmax(logits, dim=-1).gather(-1, tok[:, None])[:, 0]


def build_cos_sin_cache(max_pos: int, head_dim: int, theta: float, device: torch.device | None = None) -> torch.Tensor:
    """fp32 ``[max_pos, head_dim]``: ``[:, :hd/2] = cos(pos * inv_freq)``, ``[:, hd/2:] = sin(...)``,
    computed like HF (``inv_freq`` from an int64 arange cast to float; fp32 product; fp32 cos/sin)."""
    assert head_dim % 2 == 0
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / head_dim)
    )
    pos = torch.arange(max_pos, dtype=torch.int64, device=device).float()
    freqs = pos[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).contiguous()


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rope_one_ref(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    cs = cos_sin_cache[positions.to(torch.int64)]
    cos = torch.cat([cs[:, :half], cs[:, :half]], dim=-1).to(x.dtype)[:, None, :]
    sin = torch.cat([cs[:, half:], cs[:, half:]], dim=-1).to(x.dtype)[:, None, :]
    return (x * cos) + (_rotate_half(x) * sin)


def rope_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    """RoPE on q and k in place (HF's apply_rotary_pos_emb): twin of `kernels.rope_`."""
    q.copy_(_rope_one_ref(q, positions, cos_sin_cache))
    k.copy_(_rope_one_ref(k, positions, cos_sin_cache))


def write_kv_ref(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Scatter K/V into the paged caches at slot_mapping (-1: skipped): twin of `kernels.write_kv`."""
    bs = k_cache.shape[1]
    slots = slot_mapping.to(torch.int64)
    valid = slots >= 0
    s = slots[valid]
    k_cache[s // bs, s % bs] = k[valid].to(k_cache.dtype)
    v_cache[s // bs, s % bs] = v[valid].to(v_cache.dtype)


def rope_and_write_kv_ref(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping) -> None:
    """RoPE on q in place and on a copy of k, then k and v into the caches: twin of
    `kernels.rope_and_write_kv` (k itself is not modified)."""
    q.copy_(_rope_one_ref(q, positions, cos_sin_cache))
    k_rot = _rope_one_ref(k, positions, cos_sin_cache)
    write_kv_ref(k_rot, v, k_cache, v_cache, slot_mapping)


def rope_kv_attention_ref(
    q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, cu_seqlens_q, seq_lens, block_tables, scale,
    out=None, cu_host: list[int] | None = None, lens_host: list[int] | None = None,
) -> torch.Tensor:  # fmt: skip
    """`rope_and_write_kv_ref` on a copy of q, then `paged_attention_ref`: twin of
    `kernels.rope_kv_attention` (decode rows; q itself is not modified)."""
    q_rot = q.clone()
    rope_and_write_kv_ref(q_rot, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping)
    return paged_attention_ref(
        q_rot, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, 1, out, cu_host, lens_host
    )


def copy_kv_slots_ref(kv_all_layers, src_slots, dst_slots) -> None:
    """Copy every layer's K and V of slot src[i] to slot dst[i] (a negative entry skips the pair): twin of
    `kernels.copy_kv_slots`, the LAST_EXITED exit fill."""
    bs = kv_all_layers.shape[3]
    src = src_slots.to(torch.int64)
    dst = dst_slots.to(torch.int64)
    valid = (src >= 0) & (dst >= 0)
    src, dst = src[valid], dst[valid]
    vals = kv_all_layers[:, :, src // bs, src % bs].clone()
    kv_all_layers[:, :, dst // bs, dst % bs] = vals


def paged_attention_ref(
    q,
    k_cache,
    v_cache,
    cu_seqlens_q,
    seq_lens,
    block_tables,
    scale,
    max_seqlen_q=None,
    out=None,
    cu_host: list[int] | None = None,
    lens_host: list[int] | None = None,
) -> torch.Tensor:
    """Causal attention over the paged cache, fp32 math, one row at a time: twin of
    `kernels.paged_attention`. `cu_host` / `lens_host`: host copies of the row offsets and lengths (saves a
    device sync per call on the GPU)."""
    N, H, hd = q.shape
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    G = H // kvh
    res = torch.empty(N, H, hd, dtype=q.dtype, device=q.device) if out is None else out
    cu = cu_host if cu_host is not None else cu_seqlens_q.tolist()
    sl = lens_host if lens_host is not None else seq_lens.tolist()
    for r in range(len(sl)):
        s, e = cu[r], cu[r + 1]
        n = e - s
        if n == 0:
            continue
        L = sl[r]
        if L == 0:  # pad row: no keys, zeros (as the kernel)
            res[s:e] = 0
            continue
        pos = torch.arange(L, device=q.device)
        blocks = block_tables[r].to(torch.int64)[pos // bs]
        k = k_cache[blocks, pos % bs].float().repeat_interleave(G, dim=1)  # [L, H, hd]
        v = v_cache[blocks, pos % bs].float().repeat_interleave(G, dim=1)
        qq = q[s:e].float()
        scores = torch.einsum("qhd,khd->hqk", qq, k) * scale
        qpos = L - n + torch.arange(n, device=q.device)
        scores = scores.masked_fill(~(pos[None, :] <= qpos[:, None]), float("-inf"))
        p = torch.softmax(scores, dim=-1)
        res[s:e] = torch.einsum("hqk,khd->qhd", p, v).to(res.dtype)
    return res
