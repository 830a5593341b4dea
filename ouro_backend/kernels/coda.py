"""The greedy coda of a decode round in one kernel: LM head, argmax and the token's logprob, only when a row
emits.

The coda of a decode round (`engine/model_runner.py`) is ``logits = h @ lm_head.T`` in h's dtype, then the
argmax of every row and its logprob (``log_softmax(logits)[token]``). Done plainly it is a GEMM over the
whole vocabulary plus a few kernels over the logits, every round, although a row emits a token only in the
round where it exits: at full depth, one round in four at one row. `greedy_coda` does it in one kernel:

- it applies the round's exit rule first (`decode_step.exit_decision`, the rule `advance` applies after
  it) and, when no row exits, writes token 0 and logprob 0 for every row and returns without reading the
  LM head (those values are never recorded: `advance` takes a row's token only when the row exits);
- otherwise a persistent grid streams the LM head once: program p owns a contiguous range of BLOCK_V-row
  vocabulary tiles, walks each tile's K in BLOCK_K chunks on CUDA cores with the next chunk of w already in
  flight (the first one read before the PDL wait: w is read-only), rounds each tile's logits to h's dtype
  as the plain GEMM does, and keeps per row an online softmax: the running maximum, its first index and
  the sum of exp(logit - maximum);
- the last program to arrive (an int32 counter, `_common.arrival_counters`) combines the programs'
  partials in program order, so ties go to the lowest token id as ``argmax`` does, and writes the token
  and ``-log(sum)`` (the token's logit is the maximum), then re-arms the counter.

No logits tensor exists, so the engine uses this only where nothing reads the logits: greedy rounds without
logits recorded or deferred deep batching, at most `FUSED_CODA_MAX_ROWS` rows (`CODA_TABLE`: CUDA cores at few
rows, tensor cores with the compiler's pipelined loads beyond `MAX_FMA_M`). Its twin is
`model/torch_ops.greedy_coda_ref`: the plain coda.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..config import ExitMode
from ._common import arrival_counters, kernel_is_interpreted, next_pow2, pdl_enter, pdl_launch, round_f32, sm_count
from .decode_step import _MODES, exit_decision

MAX_M = 64  # rows the kernel takes (tensor cores beyond MAX_FMA_M)
MAX_FMA_M = 8  # rows up to which the CUDA-core path may run


@dataclass(frozen=True)
class CodaConfig:
    block_v: int = 16  # vocabulary rows of a tile
    block_k: int = 256  # K chunk (must divide the hidden size)
    num_warps: int = 4
    programs_per_sm: int = 4
    dot: bool = False  # tensor cores (tl.dot, M padded to >= 16); always beyond MAX_FMA_M rows
    num_stages: int = 1  # the tensor-core path's pipeline depth


# The config by rows (largest M, config), ascending; its last M is the most rows the engine runs the kernel
# at (FUSED_CODA_MAX_ROWS). benchmarks/kernels/coda_bench.py --sweep measures candidates.
CODA_TABLE: tuple[tuple[int, CodaConfig], ...] = (
    (1, CodaConfig(16, 512, 4, 3)),
    (2, CodaConfig(32, 256, 4, 3)),
    # from 3 rows the tensor-core tile (M padded to 16) beats CUDA cores: they redo every row's products
    (MAX_M, CodaConfig(128, 128, 4, 1, dot=True, num_stages=3)),
)
FUSED_CODA_MAX_ROWS = CODA_TABLE[-1][0]


def coda_config(M: int) -> CodaConfig:
    """The measured config for M rows (1 <= M <= FUSED_CODA_MAX_ROWS)."""
    return next(cfg for max_m, cfg in CODA_TABLE if max_m >= M)


@triton.jit
def _online_update(acc, vocab, V, run_max, run_sum, run_arg, DT: tl.constexpr, INTERP: tl.constexpr):
    """Fold one complete tile of logits (fp32 sums acc [BLOCK_V, BLOCK_M], vocabulary ids `vocab`) into each
    row's running maximum, its first index and the sum of exp(logit - maximum). The logits are rounded to
    DT first, as the GEMM's output is."""
    logit = tl.where((vocab < V)[:, None], round_f32(acc, DT, INTERP), float("-inf"))
    t_max = tl.max(logit, axis=0)  # [BLOCK_M]
    t_arg = tl.min(tl.where(logit == t_max[None, :], vocab[:, None], V), axis=0)  # first index
    new_max = tl.maximum(run_max, t_max)
    run_sum = run_sum * tl.exp(run_max - new_max) + tl.sum(tl.exp(logit - new_max[None, :]), axis=0)
    run_arg = tl.where(t_max > run_max, t_arg, run_arg)  # a tie keeps the earlier (lower) index
    return new_max, run_sum, run_arg


@triton.jit
def _greedy_coda_kernel(
    h_ptr,
    w_ptr,
    tok_ptr,
    lp_ptr,
    part_ptr,
    count_ptr,
    idx_ptr,
    ints_ptr,
    floats_ptr,
    rem_ptr,
    trace_ptr,
    lam_ptr,
    M,
    V,
    stride_h,
    stride_w,
    stride_ints,
    stride_floats,
    stride_trace,
    K: tl.constexpr,
    C_ACTIVE: tl.constexpr,
    C_LOOP: tl.constexpr,
    C_NGEN: tl.constexpr,
    C_PENDING: tl.constexpr,
    C_MIN_LOOPS: tl.constexpr,
    C_MAX_LOOPS: tl.constexpr,
    C_TRACE_LEN: tl.constexpr,
    C_THRESHOLD: tl.constexpr,
    MODE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    DOT_PREC: tl.constexpr,
    P_CHUNK: tl.constexpr,
    PDL: tl.constexpr,
    INTERP: tl.constexpr,
):
    CHUNKS: tl.constexpr = K // BLOCK_K
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    n_tiles = tl.cdiv(V, BLOCK_V)
    t_lo = pid * n_tiles // P  # a contiguous range of tiles: program order is vocabulary order
    t_hi = (pid + 1) * n_tiles // P
    n_steps = (t_hi - t_lo) * CHUNKS
    offs_v = tl.arange(0, BLOCK_V)
    offs_k = tl.arange(0, BLOCK_K)
    if not USE_DOT:  # CUDA cores: the first chunk of w in flight before the wait (read-only)
        w_rows = tl.minimum(t_lo * BLOCK_V + offs_v, V - 1).to(tl.int64)  # clamped, not masked: vector loads
        w_next = tl.load(w_ptr + w_rows[:, None] * stride_w + offs_k[None, :])
    pdl_enter(PDL)
    # Does any row exit this round? The same rule `decode_step.advance` applies after this kernel.
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    rows_m = tl.minimum(offs_m, M - 1)  # clamped: the duplicates are masked out of every decision and store
    s = tl.load(idx_ptr + rows_m).to(tl.int64)
    row = ints_ptr + s * stride_ints
    ex, _rem, _pend = exit_decision(
        row, floats_ptr + s * stride_floats, trace_ptr + s * stride_trace, tl.load(rem_ptr + s),
        tl.load(row + C_PENDING) > 0, lam_ptr + rows_m, tl.load(row + C_LOOP), tl.load(row + C_NGEN),
        C_MIN_LOOPS, C_MAX_LOOPS, C_TRACE_LEN, C_THRESHOLD, MODE,
    )  # fmt: skip
    emits = tl.max((ex & (tl.load(row + C_ACTIVE) > 0) & m_mask).to(tl.int32), axis=0)
    if emits == 0:  # every program decides alike: none reads w, none arrives
        if pid == 0:
            tl.store(tok_ptr + offs_m, tl.zeros([BLOCK_M], tl.int64), mask=m_mask)
            tl.store(lp_ptr + offs_m, tl.zeros([BLOCK_M], tl.float32), mask=m_mask)
    else:
        DT: tl.constexpr = h_ptr.dtype.element_ty
        run_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
        run_sum = tl.zeros([BLOCK_M], tl.float32)
        run_arg = tl.zeros([BLOCK_M], tl.int32)
        if USE_DOT:  # tensor cores, M padded to >= 16; the compiler pipelines the loads (num_stages deep)
            acc_mv = tl.zeros([BLOCK_M, BLOCK_V], tl.float32)
            for step in range(n_steps):
                t = t_lo + step // CHUNKS
                c = step % CHUNKS
                v_rows = tl.minimum(t * BLOCK_V + offs_v, V - 1).to(tl.int64)
                w = tl.load(w_ptr + v_rows[:, None] * stride_w + (c * BLOCK_K + offs_k)[None, :])
                x = tl.load(h_ptr + rows_m.to(tl.int64)[:, None] * stride_h + (c * BLOCK_K + offs_k)[None, :])
                if INTERP:  # the interpreter's bf16 dot reads raw bits (see _common): dot fp32 copies
                    acc_mv = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc_mv, input_precision=DOT_PREC)
                else:
                    acc_mv = tl.dot(x, tl.trans(w), acc_mv, input_precision=DOT_PREC)
                if c == CHUNKS - 1:  # the tile's logits are complete
                    run_max, run_sum, run_arg = _online_update(
                        tl.trans(acc_mv), t * BLOCK_V + offs_v, V, run_max, run_sum, run_arg, DT, INTERP
                    )
                    acc_mv = tl.zeros([BLOCK_M, BLOCK_V], tl.float32)
        else:  # CUDA cores, w one chunk ahead; each K reduction stays inside a warp
            col = offs_m[None, :]
            acc = tl.zeros([BLOCK_V, BLOCK_M], tl.float32)
            for step in range(n_steps):
                t = t_lo + step // CHUNKS
                c = step % CHUNKS
                w = w_next.to(tl.float32)
                nxt = tl.minimum(step + 1, n_steps - 1)  # the last step reloads itself (a clamp, not a mask)
                nt, nc = t_lo + nxt // CHUNKS, nxt % CHUNKS
                n_rows = tl.minimum(nt * BLOCK_V + offs_v, V - 1).to(tl.int64)
                w_next = tl.load(w_ptr + n_rows[:, None] * stride_w + (nc * BLOCK_K + offs_k)[None, :])
                for i in tl.static_range(BLOCK_M):
                    xi = tl.load(h_ptr + tl.minimum(i, M - 1) * stride_h + c * BLOCK_K + offs_k).to(tl.float32)
                    acc += tl.where(col == i, tl.sum(w * xi[None, :], axis=1)[:, None], 0.0)
                if c == CHUNKS - 1:  # the tile's logits are complete
                    run_max, run_sum, run_arg = _online_update(
                        acc, t * BLOCK_V + offs_v, V, run_max, run_sum, run_arg, DT, INTERP
                    )
                    acc = tl.zeros([BLOCK_V, BLOCK_M], tl.float32)
        # partials: [P, 3, BLOCK_M] fp32 (max, sum, argmax; token ids below 2^24 are exact)
        base = part_ptr + pid * 3 * BLOCK_M + offs_m
        tl.store(base, run_max)
        tl.store(base + BLOCK_M, run_sum)
        tl.store(base + 2 * BLOCK_M, run_arg.to(tl.float32))
        tl.debug_barrier()  # every thread's partial store happens before the release below
        arrived = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
        if arrived == P - 1:  # last to arrive: every partial is visible (acquire)
            top = tl.full([BLOCK_M], float("-inf"), tl.float32)
            for p0 in range(0, P, P_CHUNK):  # the partials in chunks of programs: the maximum first
                p = p0 + tl.arange(0, P_CHUNK)
                at = part_ptr + p[:, None] * 3 * BLOCK_M + offs_m[None, :]
                mx = tl.load(at, mask=(p < P)[:, None], other=float("-inf"), cache_modifier=".cg")
                top = tl.maximum(top, tl.max(mx, axis=0))
            total = tl.zeros([BLOCK_M], tl.float32)
            tok = tl.full([BLOCK_M], float(2**24), tl.float32)
            for p0 in range(0, P, P_CHUNK):  # then the sum and the lowest program's index at the maximum
                p = p0 + tl.arange(0, P_CHUNK)
                at = part_ptr + p[:, None] * 3 * BLOCK_M + offs_m[None, :]
                mx = tl.load(at, mask=(p < P)[:, None], other=float("-inf"), cache_modifier=".cg")
                sm = tl.load(at + BLOCK_M, mask=(p < P)[:, None], other=0.0, cache_modifier=".cg")
                ag = tl.load(at + 2 * BLOCK_M, mask=(p < P)[:, None], other=0.0, cache_modifier=".cg")
                total += tl.sum(tl.where(mx > float("-inf"), sm * tl.exp(mx - top[None, :]), 0.0), axis=0)
                tok = tl.minimum(tok, tl.min(tl.where(mx == top[None, :], ag, float(2**24)), axis=0))
            tl.store(tok_ptr + offs_m, tok.to(tl.int64), mask=m_mask)
            tl.store(lp_ptr + offs_m, -tl.log(total), mask=m_mask)
            tl.atomic_xchg(count_ptr, 0, sem="relaxed", scope="gpu")  # re-arm


def greedy_coda(
    h: torch.Tensor,
    lm_head: torch.Tensor,
    state,
    idx: torch.Tensor,
    lam: torch.Tensor | None,
    mode: ExitMode,
    cols: Mapping[str, int],
    config: CodaConfig | None = None,
    programs: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens (int64 [M]) and logprobs (fp32 [M]) of the greedy coda of decode rows `idx` (slots of the
    engine's decode state `state`) with loop output h [M, H], after loop gate values `lam` (fp32 [M], None
    for modes without a gate). When no row exits this round (the exit rule of `mode`), every row gets token
    0 and logprob 0 and the LM head is not read. `programs` overrides the grid (tests)."""
    M, H = h.shape
    V = lm_head.shape[0]
    assert 1 <= M <= MAX_M and idx.shape[0] == M, (M, idx.shape)
    cfg = config or coda_config(M)
    assert lm_head.shape[1] == H and lm_head.dtype == h.dtype and h.stride(1) == 1 and lm_head.stride(1) == 1
    block_k = min(cfg.block_k, next_pow2(H))
    assert H % block_k == 0, f"the hidden size {H} is not a multiple of the coda's K chunk {block_k}"
    dev = h.device
    n_tiles = triton.cdiv(V, cfg.block_v)
    P = min(n_tiles, programs or sm_count(dev) * cfg.programs_per_sm)
    if programs is None:  # a grid that divides the tiles evenly, if one is near: no program a tile behind
        P = next((d for d in range(P, (3 * P) // 4, -1) if n_tiles % d == 0), P)
    dot = cfg.dot or M > MAX_FMA_M
    BLOCK_M = max(16, next_pow2(M)) if dot else next_pow2(M)
    assert not dot or (cfg.block_v >= 16 and block_k >= 16), f"{cfg}: tl.dot needs tiles of >= 16"
    tok = torch.empty(M, dtype=torch.int64, device=dev)
    lp = torch.empty(M, dtype=torch.float32, device=dev)
    parts = torch.empty(P, 3, BLOCK_M, dtype=torch.float32, device=dev)
    _greedy_coda_kernel[(P,)](
        h,
        lm_head,
        tok,
        lp,
        parts,
        arrival_counters(dev, 1),
        idx,
        state.ints,
        state.floats,
        state.remaining,
        state.trace,
        state.remaining if lam is None else lam.float(),  # gate-less modes read no gate values
        M,
        V,
        h.stride(0),
        lm_head.stride(0),
        state.ints.stride(0),
        state.floats.stride(0),
        state.trace.stride(0),
        K=H,
        **{
            f"C_{name}": cols[name]
            for name in ("ACTIVE", "LOOP", "NGEN", "PENDING", "MIN_LOOPS", "MAX_LOOPS", "TRACE_LEN", "THRESHOLD")
        },
        MODE=_MODES[ExitMode(mode)],
        BLOCK_M=BLOCK_M,
        BLOCK_V=cfg.block_v,
        BLOCK_K=block_k,
        USE_DOT=dot,
        DOT_PREC="ieee" if h.dtype == torch.float32 else "tf32",
        P_CHUNK=min(128, next_pow2(P)),
        INTERP=kernel_is_interpreted(_greedy_coda_kernel),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages if dot else 1,
        **pdl_launch(_greedy_coda_kernel, dev),
    )
    return tok, lp


def fused_coda_enabled() -> bool:
    """``OURO_FUSED_CODA=0`` turns the fused coda off (the A/B switch of the benchmarks)."""
    return os.environ.get("OURO_FUSED_CODA", "1") != "0"
