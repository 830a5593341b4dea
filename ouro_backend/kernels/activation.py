"""SiLU-and-multiply for a fused gate/up projection output, plus torch reference.

``silu_mul(gate_up [N, 2I]) = silu(gate_up[:, :I]) * gate_up[:, I:]`` with torch's rounding:
``F.silu`` computes ``x / (1 + exp(-x))`` in fp32 and rounds to the dtype, then the multiply is a dtype op
(fp32 product rounded once); the kernel does exactly that, with libdevice's ``expf`` on the GPU (as torch's
CUDA kernel) and FMA contraction off. Tolerance vs torch: the division/exp may still differ in the last fp32
bit (e.g. torch's CPU kernel is vectorised differently), which can flip the last bit of a bf16 silu in rare
cases: <= 1 bf16 ulp on the silu, <= ~2 ulp on the product; fp32 results agree to ~1e-6 relative.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..model.torch_ops import silu_mul_ref  # the torch twins
from ._common import cast_rne, kernel_is_interpreted, next_pow2, pdl_enter, pdl_launch, round_f32, use_triton

try:  # full-precision expf (what torch's CUDA silu uses); the interpreter lacks libdevice
    from triton.language.extra import libdevice as _libdevice

    _HAS_LIBDEVICE = True
except Exception:  # pragma: no cover
    _libdevice = None
    _HAS_LIBDEVICE = False


@triton.jit
def silu_mul_f32(g, u, DT: tl.constexpr, INTERP: tl.constexpr, LIBDEVICE: tl.constexpr):
    """``silu(g) * u`` of fp32 values as torch rounds it in DT: the silu rounded to DT, the product left in
    fp32 for the caller to round once (shared by `_silu_mul_kernel` and the down projection's x load)."""
    if LIBDEVICE:
        e = _libdevice.exp(-g)
    else:
        e = tl.exp(-g)
    return round_f32(g / (1.0 + e), DT, INTERP) * u


@triton.jit
def _silu_mul_kernel(
    x_ptr,
    y_ptr,
    stride_xn,
    stride_yn,
    I,
    BLOCK: tl.constexpr,
    INTERP: tl.constexpr,
    LIBDEVICE: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    n = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    dt: tl.constexpr = x_ptr.dtype.element_ty
    g = tl.load(x_ptr + n * stride_xn + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + n * stride_xn + I + cols, mask=mask, other=0.0).to(tl.float32)
    y_dt: tl.constexpr = y_ptr.dtype.element_ty
    tl.store(y_ptr + n * stride_yn + cols, cast_rne(silu_mul_f32(g, u, dt, INTERP, LIBDEVICE), y_dt, INTERP), mask=mask)


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``[N, 2I] -> [N, I]``: ``silu(first half) * second half`` (row stride allowed, last dim contiguous)."""
    assert gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0, gate_up.shape
    N, I2 = gate_up.shape
    I = I2 // 2
    if out is None:
        out = torch.empty(N, I, dtype=gate_up.dtype, device=gate_up.device)
    assert out.shape == (N, I) and out.stride(1) == 1
    if N == 0:
        return out
    if not use_triton(_silu_mul_kernel, gate_up):
        out.copy_(silu_mul_ref(gate_up))
        return out
    if gate_up.stride(1) != 1:
        gate_up = gate_up.contiguous()
    block = min(1024, next_pow2(I))
    _silu_mul_kernel[(N, triton.cdiv(I, block))](
        gate_up,
        out,
        gate_up.stride(0),
        out.stride(0),
        I,
        BLOCK=block,
        INTERP=kernel_is_interpreted(_silu_mul_kernel),
        LIBDEVICE=_HAS_LIBDEVICE and not kernel_is_interpreted(_silu_mul_kernel),
        num_warps=4 if block >= 512 else 1,
        enable_fp_fusion=False,  # exact torch rounding in fp32 too
        **pdl_launch(_silu_mul_kernel, gate_up.device),
    )
    return out
