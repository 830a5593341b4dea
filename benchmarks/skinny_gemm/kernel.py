"""Skinny matmuls ``y = x @ w.T`` for decode: x [M, K] with few rows (1..64), w [N, K] a weight.

Why: at decode time the projections (qkv, o, gate_up, down) do almost no arithmetic; their cost is
streaming w from HBM. cuBLAS reaches only ~2.5 TB/s of the H200's ~4.8 TB/s on Ouro-1.4B's shapes at M=1
(measured: 123 GEMMs per decode round, 2.47 GB of weights, ~1.0 ms). Configs are picked per shape by
timing them (``bench.py`` beside this file). Not used by the engine: it gained at most 7% on the H200
(see bench.py).

Design: a program owns BLOCK_N rows of w (output columns) and one of SPLIT_K slices of K, walked in
BLOCK_K chunks (16-byte loads along K, fp32 accumulation). All M rows share that pass (BLOCK_M covers M up
to 64), so w is read once. Inner product: ``tl.dot`` with M padded to >= 16 (tensor cores idle anyway; the
compiler pipelines its loads ``num_stages`` deep), or for M <= 8 one x row at a time on CUDA cores, the K
reduction staying inside a warp.

Determinism: no float atomics. With SPLIT_K > 1 each split stores an fp32 partial; the last program of a
tile to arrive (int32 arrival counter) sums the partials in split order, writes y and re-arms the counter
for the next call / CUDA-graph replay ("serial split-K"). The counters are per device: calls must not run
concurrently on two streams.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ouro_backend.kernels._common import cast_rne, kernel_is_interpreted, next_pow2, use_triton


@triton.jit
def _load_k(ptrs, k_mask, EVEN_K: tl.constexpr):
    if EVEN_K:  # unmasked: plain 16-byte vector loads
        v = tl.load(ptrs)
    else:
        v = tl.load(ptrs, mask=k_mask, other=0.0)
    return v


@triton.jit(do_not_specialize=["M"])  # M = 1 must not compile its own variant: BLOCK_M covers it
def _skinny_kernel(
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    DOT_PREC: tl.constexpr,
    INTERP: tl.constexpr,
):
    # grid: (cdiv(N, BLOCK_N), SPLIT_K, cdiv(M, BLOCK_M))
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # clamp rather than mask the rows: loads stay unmasked (vectorised); the duplicates are never stored
    rows_n = tl.minimum(offs_n, N - 1).to(tl.int64)
    k_chunk = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K  # whole BLOCK_K chunks per split
    k_lo = pid_k * k_chunk
    k_hi = tl.minimum(k_lo + k_chunk, K)
    w_ptrs = w_ptr + rows_n[:, None] * stride_wn + (k_lo + offs_k)[None, :]  # [BLOCK_N, BLOCK_K]
    if USE_DOT:  # tensor cores; the compiler pipelines these loads (cp.async, num_stages deep)
        rows_m = tl.minimum(offs_m, M - 1).to(tl.int64)
        x_ptrs = x_ptr + rows_m[:, None] * stride_xm + (k_lo + offs_k)[None, :]  # [BLOCK_M, BLOCK_K]
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k in range(k_lo, k_hi, BLOCK_K):
            k_mask = (k + offs_k) < k_hi
            x = _load_k(x_ptrs, k_mask, EVEN_K)
            w = _load_k(w_ptrs, k_mask, EVEN_K)
            if INTERP:  # the interpreter's bf16 dot reads raw bits (see _common): dot fp32 copies
                x = x.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PREC)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
    else:  # CUDA cores, one x row at a time; the K reduction stays inside a warp (w's layout)
        acc_t = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        col = tl.arange(0, BLOCK_M)[None, :]
        for k in range(k_lo, k_hi, BLOCK_K):
            k_mask = (k + offs_k) < k_hi
            w = _load_k(w_ptrs, k_mask, EVEN_K).to(tl.float32)
            for i in tl.static_range(BLOCK_M):
                row = tl.minimum(pid_m * BLOCK_M + i, M - 1).to(tl.int64)
                xi = _load_k(x_ptr + row * stride_xm + k + offs_k, k_mask, EVEN_K).to(tl.float32)
                acc_t += tl.where(col == i, tl.sum(w * xi[None, :], axis=1)[:, None], 0.0)
            w_ptrs += BLOCK_K
        acc = tl.trans(acc_t)
    y_dtype: tl.constexpr = y_ptr.dtype.element_ty
    offs_m64 = offs_m.to(tl.int64)
    out_mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    y_ptrs = y_ptr + offs_m64[:, None] * stride_ym + offs_n[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, cast_rne(acc, y_dtype, INTERP), mask=out_mask)
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
            tl.store(y_ptrs, cast_rne(tot, y_dtype, INTERP), mask=out_mask)
            tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")  # re-arm


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    dot: bool = True  # tl.dot (any M) or multiply + tl.sum per x row (M <= MAX_FMA_M, else dot)

    @property
    def name(self) -> str:
        return (
            f"{'dot' if self.dot else 'fma'}_n{self.block_n}_k{self.block_k}_s{self.split_k}"
            f"_w{self.num_warps}_st{self.num_stages}"
        )


MAX_FMA_M = 8  # the fma path does a warp reduction per x row and chunk: beyond this, dot wins
MAX_BLOCK_M = 64

# (dot, BLOCK_N, BLOCK_K, num_warps, num_stages): the tile families worth timing. BLOCK_N * BLOCK_K * 2
# bytes of w per loop step and program; num_stages only matters for dot (the fma loads are not pipelined,
# hence its bigger BLOCK_K). SPLIT_K is chosen per shape by _split_for.
CONFIG_TABLE: tuple[tuple[bool, int, int, int, int], ...] = (
    (True, 16, 128, 4, 6),
    (True, 16, 256, 4, 4),
    (True, 32, 128, 4, 4),
    (True, 32, 256, 4, 3),
    (True, 64, 128, 4, 3),
    (False, 8, 256, 4, 1),
    (False, 16, 256, 4, 1),
    (False, 16, 512, 8, 1),
)


def _split_for(tiles: int, K: int, block_k: int, sms: int) -> int:
    """Smallest split in {1, 2, 4, 8} giving >= 1.5 programs per SM (bytes in flight), keeping >= 2
    BLOCK_K chunks per split."""
    split = 1
    while 2 * tiles * split < 3 * sms and split < 8 and K // (2 * split * block_k) >= 2:
        split *= 2
    return split


def candidate_configs(M: int, N: int, K: int, sms: int = 132) -> list[SkinnyConfig]:
    """Configs worth timing for one shape: every family at its filling split; the BLOCK_N = 16 dot ones
    also unsplit (the baseline a split must beat)."""
    out: list[SkinnyConfig] = []
    for dot, bn, bk, nw, ns in CONFIG_TABLE:
        if not dot and M > MAX_FMA_M:
            continue
        split = _split_for(triton.cdiv(N, bn), K, bk, sms)
        for s in sorted({1, split} if dot and bn == 16 else {split}):
            out.append(SkinnyConfig(bn, bk, s, nw, ns, dot))
    return out


def default_config(M: int, N: int, K: int, sms: int = 132) -> SkinnyConfig:
    """A reasonable untimed choice (the benchmark's winners should replace it)."""
    bn = 16 if N <= 4096 else 32
    return SkinnyConfig(bn, 256, _split_for(triton.cdiv(N, bn), K, 256, sms), 4, 3)


_COUNTERS: dict[tuple[str, int | None], list[torch.Tensor]] = {}


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 split-K arrival counters (the kernels leave them at 0). Old buffers are kept alive:
    a captured CUDA graph may still point at them."""
    key = (
        device.type,
        device.index if device.index is not None or device.type != "cuda" else torch.cuda.current_device(),
    )
    bufs = _COUNTERS.setdefault(key, [])
    if not bufs or bufs[-1].numel() < n:
        bufs.append(torch.zeros(max(n, 4096), dtype=torch.int32, device=device))
    return bufs[-1]


def skinny_matmul(x: torch.Tensor, w: torch.Tensor, config: SkinnyConfig | None = None) -> torch.Tensor:
    """``x @ w.T`` in x's dtype (fp32 accumulation): x [M, K], w [N, K] row-major, same dtype."""
    assert x.dim() == 2 and w.dim() == 2 and x.shape[1] == w.shape[1], (x.shape, w.shape)
    assert x.dtype == w.dtype, (x.dtype, w.dtype)
    M, K = x.shape
    N = w.shape[0]
    if not use_triton(_skinny_kernel, x, w):
        return x @ w.t()
    x = x if x.stride(1) == 1 else x.contiguous()
    w = w if w.stride(1) == 1 else w.contiguous()
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    cfg = config or default_config(M, N, K)
    dot = cfg.dot or M > MAX_FMA_M
    assert not dot or cfg.block_n >= 16, "tl.dot needs BLOCK_N >= 16"
    block_m = min(MAX_BLOCK_M, max(16 if dot else 1, next_pow2(M)))
    grid = (triton.cdiv(N, cfg.block_n), cfg.split_k, triton.cdiv(M, block_m))
    if cfg.split_k > 1:
        part = torch.empty((cfg.split_k, M, N), dtype=torch.float32, device=x.device)
        count = _counters(x.device, grid[0] * grid[2])
    else:
        part = count = y  # unused
    _skinny_kernel[grid](
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
        BLOCK_M=block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        SPLIT_K=cfg.split_k,
        EVEN_K=K % cfg.block_k == 0,
        USE_DOT=dot,
        DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32",
        INTERP=kernel_is_interpreted(_skinny_kernel),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return y
