"""Rotary position embedding (split-half / rotate_half), in place, matching HF's rounding.

cos/sin cache format (``build_cos_sin_cache``): one fp32 tensor ``[max_pos, head_dim]``; row p holds
``cos(p * inv_freq)`` in its first ``head_dim/2`` entries and ``sin(p * inv_freq)`` in the second half,
with ``inv_freq = 1 / theta ** (arange(0, hd, 2) / hd)`` and the product ``p * inv_freq`` computed in fp32,
exactly as HF's rotary embedding does (HF's ``emb = cat(freqs, freqs)`` repeats each value for both
halves, so half a row of each suffices).

HF semantics replicated: ``q_embed = q * cos + rotate_half(q) * sin`` with cos/sin cast to q.dtype first
and every op in q.dtype: three roundings for bf16/fp16 (``q*cos``, ``rotate_half(q)*sin``, the sum).
The kernels are compiled with FMA contraction off, so results (bf16, fp16 and fp32) are bitwise those of
the torch expression given the same cache. Note the cache itself: cos/sin computed on the GPU vs the CPU
can differ in the last fp32 bit; build it once (on either) and give the oracle the same one when
bitwise equality matters.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..model.torch_ops import rope_and_write_kv_ref, rope_ref  # the torch twins
from ._common import cast_rne, kernel_is_interpreted, next_pow2, pdl_enter, pdl_launch, round_f32, use_triton


@triton.jit
def _rope_heads(
    x_ptr,
    n,
    stride_n,
    stride_h,
    stride_d,
    NUM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    i,
    i_mask,
    cos,
    sin,
    HALF: tl.constexpr,
    INTERP: tl.constexpr,
):
    """Rotate the NUM heads of token n of x; returns (o1, o2, offsets, mask) for storing."""
    dt: tl.constexpr = x_ptr.dtype.element_ty
    h = tl.arange(0, BLOCK_H).to(tl.int64)
    mask = (h[:, None] < NUM) & i_mask[None, :]
    p1 = x_ptr + n * stride_n + h[:, None] * stride_h + i[None, :] * stride_d
    p2 = p1 + HALF * stride_d
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    o1 = round_f32(x1 * cos[None, :], dt, INTERP) + round_f32(-x2 * sin[None, :], dt, INTERP)
    o2 = round_f32(x2 * cos[None, :], dt, INTERP) + round_f32(x1 * sin[None, :], dt, INTERP)
    return cast_rne(o1, dt, INTERP), cast_rne(o2, dt, INTERP), p1, p2, mask


@triton.jit
def _rope_kernel(
    q_ptr,
    k_ptr,
    pos_ptr,
    cs_ptr,
    stride_qn,
    stride_qh,
    stride_qd,
    stride_kn,
    stride_kh,
    stride_kd,
    stride_cs,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    INTERP: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    n = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + n).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF).to(tl.int64)
    i_mask = i < HALF
    cos = tl.load(cs_ptr + pos * stride_cs + i, mask=i_mask, other=0.0)
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + i, mask=i_mask, other=0.0)
    q_dt: tl.constexpr = q_ptr.dtype.element_ty
    k_dt: tl.constexpr = k_ptr.dtype.element_ty
    qc = round_f32(cos, q_dt, INTERP)
    qs = round_f32(sin, q_dt, INTERP)
    o1, o2, p1, p2, mask = _rope_heads(
        q_ptr, n, stride_qn, stride_qh, stride_qd, NUM_Q_HEADS, BLOCK_HQ, i, i_mask, qc, qs, HALF, INTERP
    )
    tl.store(p1, o1, mask=mask)
    tl.store(p2, o2, mask=mask)
    kc = round_f32(cos, k_dt, INTERP)
    ks = round_f32(sin, k_dt, INTERP)
    o1, o2, p1, p2, mask = _rope_heads(
        k_ptr, n, stride_kn, stride_kh, stride_kd, NUM_K_HEADS, BLOCK_HK, i, i_mask, kc, ks, HALF, INTERP
    )
    tl.store(p1, o1, mask=mask)
    tl.store(p2, o2, mask=mask)


@triton.jit
def _rope_write_kv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    pos_ptr,
    cs_ptr,
    kc_ptr,
    vc_ptr,
    slot_ptr,
    stride_qn,
    stride_qh,
    stride_qd,
    stride_kn,
    stride_kh,
    stride_kd,
    stride_vn,
    stride_vh,
    stride_vd,
    stride_cs,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    INTERP: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    n = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + n).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF).to(tl.int64)
    i_mask = i < HALF
    cos = tl.load(cs_ptr + pos * stride_cs + i, mask=i_mask, other=0.0)
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + i, mask=i_mask, other=0.0)
    q_dt: tl.constexpr = q_ptr.dtype.element_ty
    k_dt: tl.constexpr = k_ptr.dtype.element_ty
    kc_dt: tl.constexpr = kc_ptr.dtype.element_ty
    vc_dt: tl.constexpr = vc_ptr.dtype.element_ty
    qc = round_f32(cos, q_dt, INTERP)
    qs = round_f32(sin, q_dt, INTERP)
    o1, o2, p1, p2, mask = _rope_heads(
        q_ptr, n, stride_qn, stride_qh, stride_qd, NUM_Q_HEADS, BLOCK_HQ, i, i_mask, qc, qs, HALF, INTERP
    )
    tl.store(p1, o1, mask=mask)
    tl.store(p2, o2, mask=mask)
    slot = tl.load(slot_ptr + n).to(tl.int64)
    if slot >= 0:
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        kc = round_f32(cos, k_dt, INTERP)
        ks = round_f32(sin, k_dt, INTERP)
        k1, k2, _kp1, _kp2, kmask = _rope_heads(
            k_ptr, n, stride_kn, stride_kh, stride_kd, NUM_K_HEADS, BLOCK_HK, i, i_mask, kc, ks, HALF, INTERP
        )
        h = tl.arange(0, BLOCK_HK).to(tl.int64)[:, None]
        dst = kc_ptr + blk * stride_kcb + off * stride_kcs + h * stride_kch + i[None, :] * stride_kcd
        # Names differ from the q-side ones: Triton's compiler (3.6) rejects re-binding a name to a
        # different shape inside a runtime `if`.
        if k1.dtype != kc_dt:
            k1 = cast_rne(k1.to(tl.float32), kc_dt, INTERP)
            k2 = cast_rne(k2.to(tl.float32), kc_dt, INTERP)
        tl.store(dst, k1, mask=kmask)
        tl.store(dst + HALF * stride_kcd, k2, mask=kmask)
        # V: plain copy of the whole head_dim (two halves)
        vsrc = v_ptr + n * stride_vn + h * stride_vh + i[None, :] * stride_vd
        vdst = vc_ptr + blk * stride_vcb + off * stride_vcs + h * stride_vch + i[None, :] * stride_vcd
        v1 = tl.load(vsrc, mask=kmask)
        v2 = tl.load(vsrc + HALF * stride_vd, mask=kmask)
        if v1.dtype != vc_dt:
            v1 = cast_rne(v1.to(tl.float32), vc_dt, INTERP)
            v2 = cast_rne(v2.to(tl.float32), vc_dt, INTERP)
        tl.store(vdst, v1, mask=kmask)
        tl.store(vdst + HALF * stride_vcd, v2, mask=kmask)


def check_rope_args(q, k, positions, cos_sin_cache):
    """The shapes and dtypes every RoPE kernel wants (also `attention.rope_kv_attention`'s)."""
    N, H, hd = q.shape
    assert k.dim() == 3 and k.shape[0] == N and k.shape[2] == hd, (q.shape, k.shape)
    assert hd % 2 == 0
    assert positions.shape == (N,), positions.shape
    assert cos_sin_cache.dim() == 2 and cos_sin_cache.shape[1] == hd and cos_sin_cache.stride(1) == 1, (
        cos_sin_cache.shape
    )
    assert cos_sin_cache.dtype == torch.float32, "cos_sin_cache must be fp32"


def _warps(heads_pad: int, half_pad: int) -> int:
    return max(1, min(8, heads_pad * half_pad // 256))


def rope_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    """In-place RoPE on ``q [N, H, hd]`` and ``k [N, kvh, hd]`` (any strides, e.g. views into a fused qkv
    output). ``positions``: int32/int64 ``[N]`` (each < cache rows; give pad rows a valid position such as
    0). ``cos_sin_cache``: see :func:`build_cos_sin_cache`."""
    check_rope_args(q, k, positions, cos_sin_cache)
    N, H, hd = q.shape
    if N == 0:
        return
    if not use_triton(_rope_kernel, q):
        return rope_ref(q, k, positions, cos_sin_cache)
    half = hd // 2
    bhq, bhk, bhalf = next_pow2(H), next_pow2(k.shape[1]), next_pow2(half)
    _rope_kernel[(N,)](
        q,
        k,
        positions,
        cos_sin_cache,
        *q.stride(),
        *k.stride(),
        cos_sin_cache.stride(0),
        NUM_Q_HEADS=H,
        NUM_K_HEADS=k.shape[1],
        HALF=half,
        BLOCK_HQ=bhq,
        BLOCK_HK=bhk,
        BLOCK_HALF=bhalf,
        INTERP=kernel_is_interpreted(_rope_kernel),
        num_warps=_warps(bhq, bhalf),
        enable_fp_fusion=False,  # exact torch rounding in fp32 too
        **pdl_launch(_rope_kernel, q.device),
    )


def rope_and_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Fused ``rope_`` + ``write_kv`` in one launch: q is rotated in place; the rotated k and the raw v
    go to the caches at ``slot_mapping`` (``-1``: pad row, no write). ``k`` itself is NOT modified."""
    check_rope_args(q, k, positions, cos_sin_cache)
    N, H, hd = q.shape
    kvh = k.shape[1]
    assert v.shape == k.shape
    assert k_cache.dim() == 4 and k_cache.shape[2:] == (kvh, hd) and v_cache.shape == k_cache.shape
    assert slot_mapping.shape == (N,)
    if N == 0:
        return
    if not use_triton(_rope_write_kv_kernel, q):
        return rope_and_write_kv_ref(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping)
    half = hd // 2
    bhq, bhk, bhalf = next_pow2(H), next_pow2(kvh), next_pow2(half)
    _rope_write_kv_kernel[(N,)](
        q,
        k,
        v,
        positions,
        cos_sin_cache,
        k_cache,
        v_cache,
        slot_mapping,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        cos_sin_cache.stride(0),
        *k_cache.stride(),
        *v_cache.stride(),
        NUM_Q_HEADS=H,
        NUM_K_HEADS=kvh,
        HALF=half,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_HQ=bhq,
        BLOCK_HK=bhk,
        BLOCK_HALF=bhalf,
        INTERP=kernel_is_interpreted(_rope_write_kv_kernel),
        num_warps=_warps(bhq, bhalf),
        enable_fp_fusion=False,  # exact torch rounding in fp32 too
        **pdl_launch(_rope_write_kv_kernel, q.device),
    )
