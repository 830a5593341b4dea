"""The MLP of a few decode rows, ``silu_mul(x @ gate_up.T) @ down.T``, split over the intermediate dimension so
that down's weights stream beside gate/up's instead of after them.

The two-projection path (`projections.mlp`) runs gate/up, and down only once every gate/up program has
finished: down's ramp and gate/up's tail are paid once per layer, and down (23 MB at the 1.4B shape) streams
alone. Here program p owns ``cols`` columns j of the intermediate (of I):

1. it reduces gate rows j and up rows I + j over all of H (fp32, BLOCK_K chunks of w read one chunk ahead,
   the first before the PDL wait), rounds g and u to x's dtype and applies the activation exactly as
   `activation.silu_mul` (the values the two-projection path feeds down);
2. it multiplies those by down's columns j, BLOCK_H rows at a time (also read one chunk ahead, the first
   before the wait), into an fp32 partial of every output column: ``part[p, m, :]``;
3. a second kernel sums the partials in program order (fixed, so bitwise reproducible; no float atomics)
   and rounds once to x's dtype.

Every weight byte is still read once. The partials add P x M x H x 8 bytes of traffic (P = I / cols
programs; 2.9 MB at one row of the 1.4B shape with cols = 16, mostly from L2), so this pays at one or a few
rows only. Which shapes and rows use it, with which config, is `config_for`'s measured table. The torch twin
is `mlp_ref` (the same math; the sums differ in order, so values agree to rounding).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..model.torch_ops import mlp_ref  # the torch twin
from ._common import cast_rne, kernel_is_interpreted, next_pow2, pdl_enter, pdl_launch, round_f32, use_triton
from .activation import _HAS_LIBDEVICE, silu_mul_f32


@triton.jit(do_not_specialize=["M"])
def _up_down_kernel(
    x_ptr, gu_ptr, down_ptr, part_ptr, M, H, I, stride_xm, stride_gu, stride_dh, stride_di,
    BLOCK_M: tl.constexpr, COLS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr,
    PDL: tl.constexpr, INTERP: tl.constexpr, LIBDEVICE: tl.constexpr,
):  # fmt: skip
    # grid: (cdiv(I, COLS),); H is a multiple of BLOCK_K and of BLOCK_H (the wrapper checks), so every chunk
    # is whole and no weight load is masked.
    pid = tl.program_id(0)
    cols = pid * COLS + tl.arange(0, COLS)
    col_ok = cols < I
    ci = tl.minimum(cols, I - 1).to(tl.int64)  # clamped, not masked: the duplicates' activations are zeroed
    offs_k = tl.arange(0, BLOCK_K)
    offs_h = tl.arange(0, BLOCK_H)
    g_ptrs = gu_ptr + ci[:, None] * stride_gu + offs_k[None, :]  # [COLS, BLOCK_K]: gate rows j
    u_ptrs = gu_ptr + (ci + I)[:, None] * stride_gu + offs_k[None, :]  # up rows I + j
    d_ptrs = down_ptr + offs_h[:, None].to(tl.int64) * stride_dh + ci[None, :] * stride_di  # [BLOCK_H, COLS]
    # weights are read-only: gate/up's first chunk before the wait
    g_next = tl.load(g_ptrs)
    u_next = tl.load(u_ptrs)
    pdl_enter(PDL)
    row_of = tl.arange(0, BLOCK_M)[None, :]
    acc_g = tl.zeros([COLS, BLOCK_M], tl.float32)
    acc_u = tl.zeros([COLS, BLOCK_M], tl.float32)
    for k in range(0, H, BLOCK_K):
        wg = g_next.to(tl.float32)
        wu = u_next.to(tl.float32)
        ahead = tl.minimum(k + BLOCK_K, H - BLOCK_K) - k  # the last chunk reloads itself (a clamp, not a mask)
        g_next = tl.load(g_ptrs + ahead)
        u_next = tl.load(u_ptrs + ahead)
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
        for i in tl.static_range(BLOCK_M):
            row = tl.minimum(i, M - 1).to(tl.int64)
            xi = tl.load(x_ptr + row * stride_xm + k + offs_k).to(tl.float32)[None, :]
            acc_g += tl.where(row_of == i, tl.sum(wg * xi, axis=1)[:, None], 0.0)
            acc_u += tl.where(row_of == i, tl.sum(wu * xi, axis=1)[:, None], 0.0)
    dt: tl.constexpr = x_ptr.dtype.element_ty
    g = round_f32(acc_g, dt, INTERP)
    u = round_f32(acc_u, dt, INTERP)
    act = round_f32(silu_mul_f32(g, u, dt, INTERP, LIBDEVICE), dt, INTERP)  # [COLS, BLOCK_M]
    act = tl.where(col_ok[:, None], act, 0.0)
    d_next = tl.load(d_ptrs)
    part = part_ptr + pid.to(tl.int64) * M * H  # part [P, M, H] fp32
    for h in range(0, H, BLOCK_H):
        wd = d_next.to(tl.float32)  # [BLOCK_H, COLS]
        ahead = tl.minimum(h + BLOCK_H, H - BLOCK_H) - h
        d_next = tl.load(d_ptrs + ahead * stride_dh)
        d_ptrs += BLOCK_H * stride_dh
        for i in tl.static_range(BLOCK_M):
            a_i = tl.sum(tl.where(row_of == i, act, 0.0), axis=1)  # [COLS]: row i's activations
            p_i = tl.sum(wd * a_i[None, :], axis=1)  # [BLOCK_H]
            tl.store(part + i * H + h + offs_h, p_i, mask=(offs_h * 0 + i) < M)


@triton.jit(do_not_specialize=["M", "P"])
def _sum_parts_kernel(
    part_ptr, y_ptr, P, M, H, stride_ym,
    BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    # grid: (cdiv(H, BLOCK_H), M); y[m, h] = the partials' sum over p, in a fixed order
    pid_h = tl.program_id(0)
    m = tl.program_id(1)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    offs_p = tl.arange(0, BLOCK_P)
    pdl_enter(PDL)
    acc = tl.zeros([BLOCK_P, BLOCK_H], tl.float32)
    for p0 in range(0, P, BLOCK_P):
        p = p0 + offs_p
        ptrs = part_ptr + (p[:, None].to(tl.int64) * M + m) * H + offs_h[None, :]
        acc += tl.load(ptrs, mask=(p < P)[:, None] & h_ok[None, :], other=0.0, cache_modifier=".cg")
    tot = tl.sum(acc, axis=0)
    tl.store(y_ptr + m.to(tl.int64) * stride_ym + offs_h, cast_rne(tot, y_ptr.dtype.element_ty, INTERP), mask=h_ok)


@dataclass(frozen=True)
class MlpConfig:
    cols: int  # intermediate columns a program owns (a power of 2)
    block_k: int  # gate/up's chunk of H (divides H)
    block_h: int  # down's chunk of H (divides H)
    num_warps: int = 4

    @property
    def name(self) -> str:
        return f"mlp_c{self.cols}_k{self.block_k}_h{self.block_h}_w{self.num_warps}"


MAX_ROWS = 4  # the partials grow with every row; the table's entries stay within this


def sum_launch(P: int) -> dict:
    """The partials' sum's tile and warps for P partials: all of them (up to 1,024) for 16 output columns in
    one load, so that its programs (H / 16 a row) each wait on one round trip, not one a step."""
    block_p = min(next_pow2(P), 1024)
    return dict(BLOCK_P=block_p, BLOCK_H=16, num_warps=8 if block_p >= 512 else 4)


# Measured configs by gate/up weight shape (2I, H): (largest M, config), ascending M; rows past the last entry,
# and shapes not here, run the two-projection path. Measured with benchmarks/kernels/mlp_bench.py (``fused``)
# and in the decode loop (benchmarks/kernels/loop_bench.py, ``OURO_FUSED_MLP=0`` against the default).
FUSED_MLP_TABLE: dict[tuple[int, int], tuple[tuple[int, MlpConfig], ...]] = {
    (11264, 2048): ((1, MlpConfig(16, 128, 128, 4)),),
}


def config_for(gate_up: torch.Tensor, M: int) -> MlpConfig | None:
    """The measured config of the fused MLP for this gate/up weight at M rows, or None (the two-projection
    path). ``OURO_FUSED_MLP=0`` turns it off (the A/B switch); ``OURO_LINEAR=cublas`` too (every projection
    on cuBLAS); ``OURO_LINEAR=kernel`` also runs unmeasured shapes whose H a 16-element chunk divides, at up
    to MAX_ROWS rows (how the GPU oracle tests put the toy model through it)."""
    mode = os.environ.get("OURO_LINEAR", "")
    if os.environ.get("OURO_FUSED_MLP", "1") == "0" or mode == "cublas" or not 0 < M <= MAX_ROWS:
        return None
    shape = tuple(gate_up.shape)
    for max_m, cfg in FUSED_MLP_TABLE.get(shape, ()):  # type: ignore[call-overload]
        if max_m >= M:
            return cfg
    if mode == "kernel" and shape not in FUSED_MLP_TABLE and shape[1] % 16 == 0:
        return MlpConfig(16, 16, 16, 4)
    return None


def fused_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, config: MlpConfig) -> torch.Tensor:
    """``silu_mul(x @ gate_up.T) @ down.T`` in x's dtype: x [M, H], gate_up [2I, H] (gate rows, then up
    rows), down [H, I] (row-major, or the transpose of a row-major [I, H]), one dtype, M <= MAX_ROWS, H a
    multiple of the config's chunks. Twin: `mlp_ref`."""
    M, H = x.shape
    I = gate_up.shape[0] // 2
    assert gate_up.shape == (2 * I, H) and down.shape == (H, I), (x.shape, gate_up.shape, down.shape)
    assert x.dtype == gate_up.dtype == down.dtype, (x.dtype, gate_up.dtype, down.dtype)
    assert M <= MAX_ROWS, f"the fused MLP runs at most {MAX_ROWS} rows, got {M}"
    assert H % config.block_k == 0 and H % config.block_h == 0, f"{config.name}: its chunks must divide H={H}"
    if not use_triton(_up_down_kernel, x, gate_up, down):
        return mlp_ref(x, gate_up, down)
    x = x if x.stride(1) == 1 else x.contiguous()
    gate_up = gate_up if gate_up.stride(1) == 1 else gate_up.contiguous()
    down = down if 1 in down.stride() else down.contiguous()
    y = torch.empty((M, H), dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    P = triton.cdiv(I, config.cols)
    part = torch.empty((P, M, H), dtype=torch.float32, device=x.device)
    interp = kernel_is_interpreted(_up_down_kernel)
    _up_down_kernel[(P,)](
        x, gate_up, down, part, M, H, I, x.stride(0), gate_up.stride(0), down.stride(0), down.stride(1),
        BLOCK_M=next_pow2(M), COLS=config.cols, BLOCK_K=config.block_k, BLOCK_H=config.block_h,
        INTERP=interp, LIBDEVICE=_HAS_LIBDEVICE and not interp, num_warps=config.num_warps, num_stages=1,
        **pdl_launch(_up_down_kernel, x.device),
    )  # fmt: skip
    sl = sum_launch(P)
    _sum_parts_kernel[(triton.cdiv(H, sl["BLOCK_H"]), M)](
        part, y, P, M, H, y.stride(0), INTERP=interp, **sl, **pdl_launch(_sum_parts_kernel, x.device)
    )
    return y
