"""RMSNorm kernels with Ouro's exact rounding, plus torch references.

Ouro / HF: ``RMSNorm(x) = weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)``: the normalised
value is rounded to x.dtype *before* the weight multiply, and the multiply happens in x.dtype (i.e. an
fp32 product rounded once; exact for bf16/fp16 operands, whose product fits in fp32). The kernels replicate
both roundings. The output dtype is x.dtype; this equals torch when ``weight.dtype == x.dtype`` (the
engine's case; an fp32 weight with bf16 x would make torch promote to fp32, which we do not replicate).

Remaining differences to torch are in fp32 rounding of the mean (reduction order) and of rsqrt; they can
flip the last bit of a bf16 result in rare cases (tests: bitwise equal for all but a tiny fraction,
never more than one bf16 ulp).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..model.torch_ops import rms_norm_ref, sandwich_norm_ref  # the torch twins
from ._common import cast_rne, kernel_is_interpreted, next_pow2, pdl_enter, pdl_launch, round_f32, use_triton


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    stride_xn,
    stride_yn,
    D,
    eps,
    BLOCK_D: tl.constexpr,
    INTERP: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    n = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    mask = d < D
    x_dtype: tl.constexpr = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + n * stride_xn + d, mask=mask, other=0.0).to(tl.float32)
    var = tl.sum(x * x, 0) / D
    normed = round_f32(x * tl.math.rsqrt(var + eps), x_dtype, INTERP)
    w = tl.load(w_ptr + d, mask=mask, other=0.0).to(tl.float32)
    y_dtype: tl.constexpr = y_ptr.dtype.element_ty
    tl.store(y_ptr + n * stride_yn + d, cast_rne(w * normed, y_dtype, INTERP), mask=mask)


@triton.jit
def _sandwich_norm_kernel(
    x_ptr,
    res_ptr,
    w_post_ptr,
    w_next_ptr,
    res_out_ptr,
    y_ptr,
    stride_xn,
    stride_rn,
    stride_ron,
    stride_yn,
    D,
    eps,
    BLOCK_D: tl.constexpr,
    INTERP: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    n = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    mask = d < D
    dt: tl.constexpr = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + n * stride_xn + d, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(res_ptr + n * stride_rn + d, mask=mask, other=0.0).to(tl.float32)
    w_post = tl.load(w_post_ptr + d, mask=mask, other=0.0).to(tl.float32)
    w_next = tl.load(w_next_ptr + d, mask=mask, other=0.0).to(tl.float32)
    # t = rms_norm(x, w_post) in dtype
    var = tl.sum(x * x, 0) / D
    t = round_f32(w_post * round_f32(x * tl.math.rsqrt(var + eps), dt, INTERP), dt, INTERP)
    # new_residual = residual + t in dtype
    h = round_f32(r + t, dt, INTERP)
    # y = rms_norm(new_residual, w_next)
    var2 = tl.sum(h * h, 0) / D
    y = w_next * round_f32(h * tl.math.rsqrt(var2 + eps), dt, INTERP)
    tl.store(res_out_ptr + n * stride_ron + d, cast_rne(h, dt, INTERP), mask=mask)
    tl.store(y_ptr + n * stride_yn + d, cast_rne(y, dt, INTERP), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])  # a view when possible (keeps a row stride)
    if t2.stride(-1) != 1:
        t2 = t2.contiguous()
    return t2


def _warps(block_d: int) -> int:
    return max(1, min(16, block_d // 256))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """``weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)`` over the last dim, in x.dtype.
    ``x`` may have a row stride (last dim contiguous). ``out`` (same shape, contiguous last dim) optional."""
    D = x.shape[-1]
    assert weight.shape == (D,), (weight.shape, x.shape)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out
    if not use_triton(_rms_norm_kernel, x):
        out.copy_(rms_norm_ref(x, weight, eps))
        return out
    x2, y2 = _rows(x), out.view(-1, D)
    bd = next_pow2(D)
    _rms_norm_kernel[(x2.shape[0],)](
        x2,
        weight,
        y2,
        x2.stride(0),
        y2.stride(0),
        D,
        float(eps),
        BLOCK_D=bd,
        INTERP=kernel_is_interpreted(_rms_norm_kernel),
        num_warps=_warps(bd),
        enable_fp_fusion=False,  # exact torch rounding in fp32 too
        **pdl_launch(_rms_norm_kernel, x.device),
    )
    return out


def sandwich_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    w_post: torch.Tensor,
    w_next: torch.Tensor,
    eps: float,
    *,
    residual_out: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused Ouro layer epilogue: returns ``(new_residual, y)`` with
    ``new_residual = residual + rms_norm(x, w_post)`` and ``y = rms_norm(new_residual, w_next)``, rounded
    like the two torch ops in x.dtype. One read of x and residual, two writes.
    ``residual_out=residual`` updates the residual in place (each row is read before it is written)."""
    D = x.shape[-1]
    assert residual.shape == x.shape and residual.dtype == x.dtype, (residual.shape, x.shape)
    assert w_post.shape == (D,) and w_next.shape == (D,)
    if residual_out is None:
        residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return residual_out, out
    if not use_triton(_sandwich_norm_kernel, x):
        nr, y = sandwich_norm_ref(x, residual, w_post, w_next, eps)
        residual_out.copy_(nr)
        out.copy_(y)
        return residual_out, out
    x2, r2 = _rows(x), _rows(residual)
    ro2, y2 = residual_out.view(-1, D), out.view(-1, D)
    bd = next_pow2(D)
    _sandwich_norm_kernel[(x2.shape[0],)](
        x2,
        r2,
        w_post,
        w_next,
        ro2,
        y2,
        x2.stride(0),
        r2.stride(0),
        ro2.stride(0),
        y2.stride(0),
        D,
        float(eps),
        BLOCK_D=bd,
        INTERP=kernel_is_interpreted(_sandwich_norm_kernel),
        num_warps=_warps(bd),
        enable_fp_fusion=False,  # exact torch rounding in fp32 too
        **pdl_launch(_sandwich_norm_kernel, x.device),
    )
    return residual_out, out
