"""Decode projections ``y = x @ w.T`` for few rows (x [M, K], M <= 64; w [N, K] a weight), plus the SiLU-and-
multiply of the MLP fused into the down projection's input.

At decode time a projection does almost no arithmetic: its cost is streaming w from HBM once. What a
kernel per projection loses against that floor is mostly fixed: its launch, the ramp until enough loads are
in flight, and the tail of its last programs. This kernel attacks those:

- it is launched with programmatic dependent launch (`_common.pdl_launch`), so it starts while the kernel
  before it finishes; on the CUDA-core path each program reads its first chunk of w before it waits for that
  kernel (`pdl_enter`; w is read-only, the one thing it may touch early) and then stays one chunk ahead. A
  config whose split of K is a single chunk (BLOCK_K x SPLIT_K >= K) holds its whole slice of w before the
  wait (``ONE_CHUNK``): after a long latency-bound kernel (decode attention) its weights have streamed by
  the time x is ready (which projections use it: the table; why: docs/engine.md);
- the MLP's SiLU-and-multiply without a kernel of its own (`mlp` picks): ``glu`` puts it in the gate/up
  projection's epilogue (a tile holds gate and up rows in pairs, so each program finishes whole output
  columns; both paths), ``silu_x`` in the down projection's x load (CUDA-core path only: per x tile, every
  tensor-core program would recompute it, so that path runs `activation.silu_mul` first). Either way the
  values are bitwise those of `activation.silu_mul`.

Layout: a program owns BLOCK_N rows of w (output columns) and one of SPLIT_K slices of K, walked in BLOCK_K
chunks, fp32 accumulation. All M rows share that pass (BLOCK_M covers M), so w is read once. Inner product:
``tl.dot`` with M padded to >= 16, or for M <= 8 on CUDA cores: either a warp reduction per x row and chunk,
or (``defer_sum``) per-lane products of every row summed across chunks and reduced once at the end (fewer
instructions per weight byte, BLOCK_M x BLOCK_N x BLOCK_K accumulators).

Determinism: no float atomics. With SPLIT_K > 1 each split stores an fp32 partial; the last program of a
tile to arrive (an int32 counter) sums the partials in split order, writes y and re-arms the counter for the
next call or graph replay. Counters are per device and stream.

Which shapes use it, with which config, is `config_for`'s measured table; everything else (prompt chunks,
large M, unknown shapes) stays on cuBLAS. The torch twin is ``x @ w.T`` (after ``silu_mul_ref`` for
``silu_x``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..model.torch_ops import linear_ref, mlp_ref  # the torch twins
from ._common import (
    arrival_counters,
    cast_rne,
    kernel_is_interpreted,
    next_pow2,
    pdl_enter,
    pdl_launch,
    round_f32,
    use_triton,
)
from .activation import _HAS_LIBDEVICE, silu_mul, silu_mul_f32


@triton.jit
def _load_x(ptrs, k_mask, K, EVEN_K: tl.constexpr, SILU_X: tl.constexpr, INTERP: tl.constexpr, LIBDEVICE: tl.constexpr):
    """x values at ``ptrs`` (fp32, rounded to x's dtype); with SILU_X, ``silu(g) * u`` of the gate/up row
    (g at ptrs, u at ptrs + K), rounded exactly as `activation._silu_mul_kernel`."""
    dt: tl.constexpr = ptrs.dtype.element_ty
    if EVEN_K:
        v = tl.load(ptrs).to(tl.float32)
    else:
        v = tl.load(ptrs, mask=k_mask, other=0.0).to(tl.float32)
    if SILU_X:
        if EVEN_K:
            u = tl.load(ptrs + K).to(tl.float32)
        else:
            u = tl.load(ptrs + K, mask=k_mask, other=0.0).to(tl.float32)
        v = round_f32(silu_mul_f32(v, u, dt, INTERP, LIBDEVICE), dt, INTERP)
    return v


@triton.jit
def _load_w(ptrs, k_mask, EVEN_K: tl.constexpr):
    if EVEN_K:  # unmasked: plain 16-byte vector loads
        w = tl.load(ptrs)
    else:
        w = tl.load(ptrs, mask=k_mask, other=0.0)
    return w


@triton.jit
def _l2_ahead(l2_ptr, l2_len, l2_stride, RANGES: tl.constexpr, LANES: tl.constexpr):
    """Fire-and-forget L2 prefetch of another kernel's weight: RANGES ranges of ``l2_len`` elements, at
    ``l2_ptr + r * l2_stride``, split evenly over every program's LANES lanes (one bulk prefetch a lane and
    range). ``l2_len`` is a multiple of 8 elements (the instruction moves 16-byte multiples)."""
    P = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
    p = tl.program_id(0) + tl.num_programs(0) * (tl.program_id(1) + tl.num_programs(1) * tl.program_id(2))
    chunk = tl.cdiv(tl.cdiv(l2_len, P * LANES), 8) * 8
    off = (p * LANES + tl.arange(0, LANES)).to(tl.int64) * chunk
    size = tl.maximum(tl.minimum(off + chunk, l2_len) - off, 0)
    elem_bytes: tl.constexpr = l2_ptr.dtype.element_ty.primitive_bitwidth // 8
    for r in tl.static_range(RANGES):
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r",
            [l2_ptr + r * l2_stride + off, (size * elem_bytes).to(tl.int32)],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


@triton.jit(do_not_specialize=["M"])  # M = 1 must not compile its own variant: BLOCK_M covers it
def _linear_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    part_ptr,
    count_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    l2_ptr,
    l2_len,
    l2_stride,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    DOT_PREC: tl.constexpr,
    SILU_X: tl.constexpr,
    GLU: tl.constexpr,
    PREFETCH: tl.constexpr,
    ONE_CHUNK: tl.constexpr,
    DEFER_SUM: tl.constexpr,
    L2_RANGES: tl.constexpr,
    L2_LANES: tl.constexpr,
    PDL: tl.constexpr,
    INTERP: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    # grid: (cdiv(N, BLOCK_N), SPLIT_K, cdiv(M, BLOCK_M))
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # clamp rather than mask the rows: loads stay unmasked (vectorised); the duplicates are never stored
    if GLU:  # w is gate/up [2I, K]: the tile's row i is gate row j + i // 2 (i even), up row I + j + i // 2 (odd)
        half_n = N // 2
        pair = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N) // 2
        rows_n = (tl.minimum(pair, half_n - 1) + (tl.arange(0, BLOCK_N) % 2) * half_n).to(tl.int64)
    else:
        rows_n = tl.minimum(offs_n, N - 1).to(tl.int64)
    k_chunk = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K  # whole BLOCK_K chunks per split
    k_lo = pid_k * k_chunk
    k_hi = tl.minimum(k_lo + k_chunk, K)
    w_ptrs = w_ptr + rows_n[:, None] * stride_wn + (k_lo + offs_k)[None, :]  # [BLOCK_N, BLOCK_K]
    if PREFETCH:  # (CUDA-core path, whole chunks) the first chunk of w in flight before the wait
        w_next = tl.load(w_ptrs)
    if L2_RANGES > 0 and not INTERP:  # after this kernel's own first reads: they are needed sooner
        _l2_ahead(l2_ptr, l2_len, l2_stride, L2_RANGES, L2_LANES)
    pdl_enter(PDL)
    rows_m = tl.minimum(offs_m, M - 1).to(tl.int64)  # clamped like rows_n: the duplicates are never stored
    if USE_DOT:  # tensor cores; the compiler pipelines these loads (cp.async, num_stages deep)
        x_ptrs = x_ptr + rows_m[:, None] * stride_xm + (k_lo + offs_k)[None, :]  # [BLOCK_M, BLOCK_K]
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k in range(k_lo, k_hi, BLOCK_K):
            k_mask = (k + offs_k) < k_hi
            x = _load_x(x_ptrs, k_mask[None, :], K, EVEN_K, False, INTERP, LIBDEVICE)  # SILU_X is False here
            w = _load_w(w_ptrs, k_mask[None, :], EVEN_K)
            if INTERP:  # the interpreter's bf16 dot reads raw bits (see _common): dot fp32 copies
                w = w.to(tl.float32)
            else:
                x = x.to(w_ptr.dtype.element_ty)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PREC)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
    else:  # CUDA cores; each K reduction stays inside a warp (w's layout)
        if DEFER_SUM:  # products summed per lane across chunks (every row at once); one reduction at the end
            acc3 = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
        else:  # a warp reduction per row and chunk
            acc_t = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            col = tl.arange(0, BLOCK_M)[None, :]
        for k in range(k_lo, k_hi, BLOCK_K):
            k_mask = (k + offs_k) < k_hi
            if ONE_CHUNK:  # the split's only chunk, read before the wait: nothing ahead
                w = w_next.to(tl.float32)
            elif PREFETCH:  # one chunk ahead; the last chunk reloads itself (a clamp, not a mask)
                w = w_next.to(tl.float32)
                w_next = tl.load(w_ptrs + (tl.minimum(k + BLOCK_K, k_hi - BLOCK_K) - k))
            else:
                w = _load_w(w_ptrs, k_mask[None, :], EVEN_K).to(tl.float32)
            if DEFER_SUM:
                x_ptrs = x_ptr + rows_m[:, None] * stride_xm + (k + offs_k)[None, :]  # [BLOCK_M, BLOCK_K]
                xs = _load_x(x_ptrs, k_mask[None, :], K, EVEN_K, SILU_X, INTERP, LIBDEVICE)
                acc3 += w[None, :, :] * xs[:, None, :]
            else:
                for i in tl.static_range(BLOCK_M):
                    row = tl.minimum(pid_m * BLOCK_M + i, M - 1).to(tl.int64)
                    xi = _load_x(x_ptr + row * stride_xm + k + offs_k, k_mask, K, EVEN_K, SILU_X, INTERP, LIBDEVICE)
                    acc_t += tl.where(col == i, tl.sum(w * xi[None, :], axis=1)[:, None], 0.0)
            w_ptrs += BLOCK_K
        if DEFER_SUM:
            acc = tl.sum(acc3, axis=2)  # [BLOCK_M, BLOCK_N]
        else:
            acc = tl.trans(acc_t)
    # NOTE: with GLU, columns of acc and of the partials are tile slots (2 j + gate/up), not output columns;
    # slot < N exactly when its output column j < I, so out_mask covers both.
    offs_m64 = offs_m.to(tl.int64)
    out_mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if SPLIT_K == 1:
        _store_y(y_ptr, acc, offs_m64, pid_n, M, N, stride_ym, BLOCK_M, BLOCK_N, GLU, INTERP, LIBDEVICE)
    else:
        split_stride = M.to(tl.int64) * N  # partials: [SPLIT_K, M, N] fp32
        p_ptrs = part_ptr + offs_m64[:, None] * N + offs_n[None, :]
        tl.store(p_ptrs + pid_k * split_stride, acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partial store happens before the release below
        tile = pid_m * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:  # last to arrive: the other partials are visible (acquire)
            tot = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for s in tl.static_range(SPLIT_K):  # fixed order -> bitwise reproducible
                tot += tl.load(p_ptrs + s * split_stride, mask=out_mask, other=0.0, cache_modifier=".cg")
            _store_y(y_ptr, tot, offs_m64, pid_n, M, N, stride_ym, BLOCK_M, BLOCK_N, GLU, INTERP, LIBDEVICE)
            tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")  # re-arm


@triton.jit
def _store_y(
    y_ptr, acc, offs_m64, pid_n, M, N, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GLU: tl.constexpr, INTERP: tl.constexpr, LIBDEVICE: tl.constexpr,
):  # fmt: skip
    """Store a finished fp32 tile: ``acc`` rounded to y's dtype, or with GLU ``silu(g) * u`` of its (gate, up)
    slot pairs, each product rounded to y's dtype first: exactly what storing the gate/up output and then
    running `activation.silu_mul` on it gives."""
    y_dtype: tl.constexpr = y_ptr.dtype.element_ty
    row_ok = (offs_m64 < M)[:, None]
    if GLU:
        HALF: tl.constexpr = BLOCK_N // 2
        g, u = tl.split(tl.reshape(round_f32(acc, y_dtype, INTERP), [BLOCK_M, HALF, 2]))
        cols = pid_n * HALF + tl.arange(0, HALF)
        out = silu_mul_f32(g, u, y_dtype, INTERP, LIBDEVICE)
        tl.store(
            y_ptr + offs_m64[:, None] * stride_ym + cols[None, :],
            cast_rne(out, y_dtype, INTERP),
            mask=row_ok & (cols < N // 2)[None, :],
        )
    else:
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = row_ok & (cols < N)[None, :]
        tl.store(y_ptr + offs_m64[:, None] * stride_ym + cols[None, :], cast_rne(acc, y_dtype, INTERP), mask=mask)


@dataclass(frozen=True)
class LinearConfig:
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    dot: bool = True  # tl.dot (any M) or multiply and sum on CUDA cores (M <= MAX_FMA_M, else dot)
    prefetch: bool = True  # CUDA-core path: w's first chunk read before the PDL wait, then one chunk ahead
    defer_sum: bool = False  # CUDA-core path: per-lane partial products of every row, one reduction at the end

    @property
    def name(self) -> str:
        return (
            f"{'dot' if self.dot else 'fma'}_n{self.block_n}_k{self.block_k}_s{self.split_k}"
            f"_w{self.num_warps}_st{self.num_stages}{'' if self.prefetch else '_nopf'}{'_ds' if self.defer_sum else ''}"
        )


MAX_FMA_M = 8  # the CUDA-core path's work grows with every row (reductions or accumulators): beyond this, dot wins
MAX_M = 64  # decode rows; beyond this cuBLAS


def _fma(bn: int, bk: int, split: int = 1, warps: int = 8, defer_sum: bool = False) -> LinearConfig:
    return LinearConfig(bn, bk, split, warps, 1, dot=False, defer_sum=defer_sum)


def _dot(bn: int, bk: int, split: int = 1, warps: int = 4, stages: int = 4) -> LinearConfig:
    return LinearConfig(bn, bk, split, warps, stages, dot=True)


# Decode configs by weight shape (N, K): (largest M, config or None for cuBLAS), ascending M. Candidates come
# from benchmarks/kernels/linear_bench.py (each projection timed alone) or hand-written sweeps (the results
# folders keep them); benchmarks/kernels/loop_bench.py ``tune`` ranks them in the decode loop, cuBLAS included
# (a config that wins alone can lose between the other kernels), and a new entry must also win end to end
# (benchmarks/kernels/bench_with_tune.py beside plain ouro-bench: the loop can disagree, docs/engine.md,
# "Measurements behind the design"). Shapes of Ouro-1.4B/2.6B: hidden 2048, MLP 5632; the last row is down
# (SiLU-mul fused on the CUDA-core path).
DECODE_TABLE: dict[tuple[int, int], tuple[tuple[int, LinearConfig | None], ...]] = {
    (6144, 2048): (  # qkv
        (1, _fma(4, 256, 1, 4)),
        (2, _fma(4, 512, 1, 4, defer_sum=True)),
        (8, _dot(64, 128, 2, 4, 3)),
        (16, _dot(32, 128, 4, 4, 4)),
        (64, None),
    ),
    (2048, 2048): (  # o: after attention, a program holds its whole slice of w before the wait (one chunk)
        (4, _fma(8, 2048, 1, 4)),
        (8, None),
        (16, _dot(16, 128, 4, 4, 6)),
        (48, None),
        (64, _dot(16, 256, 1, 4, 4)),
    ),
    (11264, 2048): (  # gate_up
        (1, _fma(16, 256, 1, 4)),
        (4, None),
        (8, _dot(64, 128, 1, 4, 3)),
        (16, _dot(32, 128, 1, 4, 4)),
        (64, None),
    ),
    (2048, 5632): (  # down
        (1, _fma(8, 512, 2, 4)),
        (16, _dot(32, 128, 4, 4, 4)),
        (48, None),
        (64, _dot(32, 128, 4, 4, 4)),
    ),
}


def config_for(N: int, K: int, M: int) -> LinearConfig | None:
    """The measured config for a weight [N, K] at M rows, or None (cuBLAS). ``OURO_LINEAR``: ``cublas`` turns
    the kernel off (the A/B switch of the benchmarks); ``kernel`` also runs unmeasured shapes with a small
    default tile (how the GPU oracle tests put the toy model's projections through it)."""
    mode = os.environ.get("OURO_LINEAR", "")
    if M > MAX_M or mode == "cublas":
        return None
    if (N, K) in DECODE_TABLE:
        return _row_entry(DECODE_TABLE[(N, K)], M, None)
    if mode == "kernel":
        return _fma(16, 64, 1, 4) if M <= MAX_FMA_M else _dot(16, 64, 1, 4, 2)
    return None


# Where a projection's programs wait (PDL) on a latency-bound kernel, HBM idles: they ask L2 for the first
# share of the next projection's weight, so that it finds that part in L2 (`linear`'s ``next_weight``).
# Shares by weight shape (N, K): (largest M, share), ascending M; measured with
# benchmarks/kernels/loop_bench.py ``variants`` (the ``l2_*`` rows). ``OURO_L2_AHEAD=0`` turns it off.
L2_AHEAD_TABLE: dict[tuple[int, int], tuple[tuple[int, float], ...]] = {
    (2048, 2048): ((1, 0.25),),  # o, after decode attention; the next weight is gate/up
}


def l2_ahead_share(N: int, K: int, M: int) -> float:
    """The measured share of the next weight that the projection [N, K] at M rows asks L2 for (0: none)."""
    if os.environ.get("OURO_L2_AHEAD", "1") == "0":
        return 0.0
    return _row_entry(L2_AHEAD_TABLE.get((N, K), ()), M, 0.0)


def _row_entry(rows, M: int, default):
    """The entry of a table's (largest M, entry) rows, in ascending M, that covers M rows; ``default`` past
    the last."""
    for max_m, entry in rows:
        if max_m >= M:
            return entry
    return default


def l2_ranges_of(v: torch.Tensor, share: float) -> tuple[int, int, int]:
    """(ranges, elements a range, stride between ranges) of the first ``share`` of weight v [R, K']: of each
    half when R is even (a gate/up weight is read in gate/up row pairs), whole rows, a multiple of 8 elements
    (the prefetch moves 16-byte multiples of a 16-bit dtype, and 32-byte multiples of fp32)."""
    if share <= 0:
        return 0, 0, 0
    ranges = 2 if v.shape[0] % 2 == 0 else 1
    rows = v.shape[0] // ranges
    n = int(rows * min(share, 1.0)) * v.shape[1] // 8 * 8
    return (ranges, n, rows * v.shape[1]) if n else (0, 0, 0)


def launch_constants(
    cfg: LinearConfig, M: int, K: int, dtype: torch.dtype, silu_x: bool, glu: bool = False, l2_ranges: int = 0
) -> dict:
    """The kernel's shape constexprs for `cfg` at M rows (what `linear` launches and
    benchmarks/kernels/aot_check.py compiles). Beyond MAX_FMA_M rows the tensor-core path runs whatever
    `cfg.dot` says, and it never fuses SiLU into x (per x tile, every program would recompute it): SILU_X is
    then False and `linear` runs the activation kernel first. GLU (the activation in the epilogue) runs on
    both paths."""
    dot = cfg.dot or M > MAX_FMA_M
    chunks = triton.cdiv(K, cfg.block_k)
    assert triton.cdiv(chunks, cfg.split_k) * (cfg.split_k - 1) < chunks, f"{cfg.name}: a split of K={K} is empty"
    assert not dot or (cfg.block_n >= 16 and cfg.block_k >= 16), f"{cfg.name}: tl.dot needs BLOCK_N, BLOCK_K >= 16"
    assert not (glu and silu_x), "the activation goes in gate/up's epilogue or down's x load, not both"
    assert not glu or cfg.block_n % 2 == 0, f"{cfg.name}: GLU pairs tile rows, BLOCK_N must be even"
    prefetch = cfg.prefetch and not dot and K % cfg.block_k == 0
    return dict(
        BLOCK_M=min(MAX_M, max(16 if dot else 1, next_pow2(M))),
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        SPLIT_K=cfg.split_k,
        EVEN_K=K % cfg.block_k == 0,
        USE_DOT=dot,
        DOT_PREC="ieee" if dtype == torch.float32 else "tf32",
        SILU_X=silu_x and not dot,
        GLU=glu,
        PREFETCH=prefetch,
        ONE_CHUNK=prefetch and triton.cdiv(chunks, cfg.split_k) == 1,  # (only the read-ahead path uses it)
        DEFER_SUM=cfg.defer_sum and not dot,
        L2_RANGES=l2_ranges,
        L2_LANES=32 * cfg.num_warps,
    )


def linear(
    x: torch.Tensor,
    w: torch.Tensor,
    *,
    silu_x: bool = False,
    glu: bool = False,
    config: LinearConfig | None = None,
    next_weight: torch.Tensor | None = None,
    l2_share: float | None = None,
) -> torch.Tensor:
    """``x @ w.T`` in x's dtype: x [M, K], w [N, K] row-major, one dtype. ``silu_x``: x is a gate/up output
    [M, 2K] and the result is ``silu_mul(x) @ w.T``. ``glu``: w is a gate/up weight [2I, K] and the result is
    ``silu_mul(x @ w.T)`` [M, I], the activation applied to the finished tile. Runs the kernel with ``config``
    or the measured `config_for`; cuBLAS (and the activation kernel) otherwise. ``next_weight``: the weight
    the next projection reads; before its PDL wait the kernel asks L2 for its first share (`l2_ahead_share`'s
    table, or ``l2_share``; nothing when 0 or on cuBLAS)."""
    assert x.dim() == 2 and w.dim() == 2 and x.dtype == w.dtype, (x.shape, w.shape, x.dtype, w.dtype)
    M = x.shape[0]
    N, K = w.shape
    assert x.shape[1] == (2 * K if silu_x else K), (x.shape, w.shape, silu_x)
    assert not glu or N % 2 == 0, ("a gate/up weight has an even number of rows", w.shape)
    if not use_triton(_linear_kernel, x, w):
        return linear_ref(x, w, silu_x, glu)
    cfg = config or config_for(N, K, M)
    if cfg is None:  # cuBLAS (and the activation kernel)
        y = (silu_mul(x) if silu_x else x) @ w.t()
        return silu_mul(y) if glu else y
    l2_ptr, l2_ranges, l2_len, l2_stride = w, 0, 0, 0
    if next_weight is not None:
        share = l2_ahead_share(N, K, M) if l2_share is None else l2_share
        l2_ranges, l2_len, l2_stride = l2_ranges_of(next_weight, share)
        if l2_ranges:
            assert next_weight.is_contiguous() and next_weight.dtype == w.dtype, (next_weight.dtype, w.dtype)
            l2_ptr = next_weight
    consts = launch_constants(cfg, M, K, x.dtype, silu_x, glu, l2_ranges)
    if silu_x and not consts["SILU_X"]:
        x = silu_mul(x)
    x = x if x.stride(1) == 1 else x.contiguous()
    w = w if w.stride(1) == 1 else w.contiguous()
    y = torch.empty((M, N // 2 if glu else N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    grid = (triton.cdiv(N, cfg.block_n), cfg.split_k, triton.cdiv(M, consts["BLOCK_M"]))
    if cfg.split_k > 1:
        part = torch.empty((cfg.split_k, M, N), dtype=torch.float32, device=x.device)
        count = arrival_counters(x.device, grid[0] * grid[2])
    else:
        part = count = y  # unused
    interp = kernel_is_interpreted(_linear_kernel)
    _linear_kernel[grid](
        x,
        w,
        y,
        part,
        count,
        M,
        N,
        K,
        x.stride(0),
        w.stride(0),
        y.stride(0),
        l2_ptr,
        l2_len,
        l2_stride,
        INTERP=interp,
        LIBDEVICE=_HAS_LIBDEVICE and not interp,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **consts,
        **pdl_launch(_linear_kernel, x.device),
    )
    return y


def mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The MLP ``silu_mul(x @ gate_up.T) @ down.T`` in two kernels, the activation where it costs least: in
    gate/up's epilogue (``glu``) when the kernel runs gate/up at these rows (`config_for`); otherwise gate/up
    is cuBLAS and the activation goes into down's x load (``silu_x``, its CUDA-core path) or its own kernel.
    Both give the same values bitwise (the same roundings). ``OURO_GLU=0`` keeps the activation out of the
    epilogue (the A/B switch of the benchmarks)."""
    if not use_triton(_linear_kernel, x, gate_up):
        return mlp_ref(x, gate_up, down)
    if glu_in_epilogue(gate_up, x.shape[0]):
        return linear(linear(x, gate_up, glu=True), down)
    return linear(linear(x, gate_up), down, silu_x=True)


def glu_in_epilogue(gate_up: torch.Tensor, M: int) -> bool:
    """Whether `mlp` puts the activation in gate/up's epilogue at M rows (the kernel runs gate/up there)."""
    return os.environ.get("OURO_GLU", "1") != "0" and config_for(*gate_up.shape, M) is not None
