"""The decode state machine around one loop as two fused kernels (one program per decode row). The engine
owns the state and its torch twins (``DecodeState`` in ``ouro_backend/engine/decode_state.py``, same results
bit for bit) and calls these on CUDA; the state's layout comes in as ``cols`` (column name -> index), so the kernels
need
nothing from the engine.

In torch the two steps are dozens of small launches a round (about seventy); fused, they are two
(docs/engine.md, "Measurements behind the design").

``prepare`` writes the loop's inputs (position, KV slot, sequence length, the plane's block table, the
input row: the token's embedding at loop 1, else the carried hidden state, and the KV slot of the position
in every plane). ``advance`` applies the exit rule of the engine's exit mode
(fp32 hazard, float64 threshold compare, as the torch rule), writes each row's next step and the round's
record (including which stop rule ended a row), and emits the LAST_EXITED fill pairs. ``state`` is the engine's
decode state (its ``ints``,
``floats``, ``remaining``, ``trace``, ``tables`` and ``hidden`` tensors).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import triton
import triton.language as tl

from ..config import ExitMode
from ._common import next_pow2

_MODES = {
    ExitMode.OURO: 0,
    ExitMode.OURO_DELAYED: 1,
    ExitMode.RANDOM_LOOKAHEAD: 2,
    ExitMode.TRACE: 3,
    ExitMode.FIXED: 4,
}


@triton.jit
def _prepare_kernel(
    idx_ptr,
    ints_ptr,
    tables_ptr,
    hidden_ptr,
    embed_ptr,
    pos_ptr,
    slot_ptr,
    lens_ptr,
    tab_out_ptr,
    h_ptr,
    slots_all_ptr,
    stride_ints,
    stride_ts,
    stride_tp,
    stride_hid,
    stride_emb,
    stride_tout,
    stride_h,
    W,
    H,
    C_ACTIVE: tl.constexpr,
    C_TOKEN: tl.constexpr,
    C_POS: tl.constexpr,
    C_LOOP: tl.constexpr,
    T: tl.constexpr,
    T_PAD: tl.constexpr,
    BS: tl.constexpr,
    LAST_EXITED: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    s = tl.load(idx_ptr + i).to(tl.int64)
    row = ints_ptr + s * stride_ints
    active = tl.load(row + C_ACTIVE) > 0
    pos = tl.where(active, tl.load(row + C_POS), 0)
    loop = tl.load(row + C_LOOP)
    if LAST_EXITED:
        plane = tl.minimum(tl.maximum(loop - 1, 0), T - 1)
    else:
        plane = loop * 0 + (T - 1)
    t = tl.arange(0, T_PAD).to(tl.int64)
    blk = tl.load(tables_ptr + s * stride_ts + t * stride_tp + pos // BS, mask=t < T, other=0).to(tl.int64)
    slots = blk * BS + pos % BS
    tl.store(slots_all_ptr + i * T + t, slots, mask=t < T)
    mine = tl.sum(tl.where(t == plane, slots, 0))
    tl.store(slot_ptr + i, tl.where(active, mine, -1))
    tl.store(pos_ptr + i, pos)
    tl.store(lens_ptr + i, tl.where(active, pos + 1, 1).to(tl.int32))
    src_tab = tables_ptr + s * stride_ts + plane * stride_tp
    for w0 in range(0, W, BLOCK_W):
        w = w0 + tl.arange(0, BLOCK_W)
        tl.store(tab_out_ptr + i * stride_tout + w, tl.load(src_tab + w, mask=w < W), mask=w < W)
    tok = tl.load(row + C_TOKEN).to(tl.int64)
    first = loop == 1
    for h0 in range(0, H, BLOCK_H):
        hh = h0 + tl.arange(0, BLOCK_H)
        e = tl.load(embed_ptr + tok * stride_emb + hh, mask=hh < H)
        x = tl.load(hidden_ptr + s * stride_hid + hh, mask=hh < H)
        tl.store(h_ptr + i * stride_h + hh, tl.where(first, e, x), mask=hh < H)


def prepare(
    state, idx: torch.Tensor, embed: torch.Tensor, block_size: int, last_exited: bool, cols: Mapping[str, int]
) -> tuple[torch.Tensor, ...]:
    """The loop's inputs of decode rows `idx`: (pos, slot, seq_lens, tables, h, slots_all)."""
    S, T, W = idx.shape[0], state.num_loops, state.max_blocks
    H = state.hidden.shape[1]
    dev = state.ints.device
    pos, slot = torch.empty(S, dtype=torch.int64, device=dev), torch.empty(S, dtype=torch.int64, device=dev)
    seq_lens = torch.empty(S, dtype=torch.int32, device=dev)
    tables = torch.empty(S, W, dtype=torch.int32, device=dev)
    h = torch.empty(S, H, dtype=state.hidden.dtype, device=dev)
    slots_all = torch.empty(S, T, dtype=torch.int64, device=dev)
    _prepare_kernel[(S,)](
        idx,
        state.ints,
        state.tables,
        state.hidden,
        embed,
        pos,
        slot,
        seq_lens,
        tables,
        h,
        slots_all,
        state.ints.stride(0),
        state.tables.stride(0),
        state.tables.stride(1),
        state.hidden.stride(0),
        embed.stride(0),
        tables.stride(0),
        h.stride(0),
        W,
        H,
        C_ACTIVE=cols["ACTIVE"],
        C_TOKEN=cols["TOKEN"],
        C_POS=cols["POS"],
        C_LOOP=cols["LOOP"],
        T=T,
        T_PAD=next_pow2(T),
        BS=block_size,
        LAST_EXITED=last_exited,
        BLOCK_W=min(next_pow2(W), 1024),
        BLOCK_H=min(next_pow2(H), 1024),
        num_warps=4,
    )
    return pos, slot, seq_lens, tables, h, slots_all


@triton.jit
def exit_decision(
    row,
    frow,
    trow,
    rem,
    pending,
    lam_at,
    r,
    ngen,
    C_MIN_LOOPS: tl.constexpr,
    C_MAX_LOOPS: tl.constexpr,
    C_TRACE_LEN: tl.constexpr,
    C_THRESHOLD: tl.constexpr,
    MODE: tl.constexpr,
):
    """The exit rule of one decode row after loop `r` (``engine/exit_policy.exit_rule``, bit for bit): (exit
    now, the hazard and the pending flag to carry). `row`, `frow`, `trow`: the row's ints, floats and trace;
    `lam_at`: its gate value (read only by the gated modes); `ngen`: tokens generated so far. The caller
    masks idle rows."""
    rem2 = rem
    pend2 = pending
    if MODE == 3:  # trace: this token's depth from the request's list, cycled over decode steps
        n = tl.maximum(tl.load(row + C_TRACE_LEN), 1)
        k = tl.maximum(ngen - 1, 0) % n
        ex = r >= tl.load(trow + k)
    elif MODE == 4:  # fixed depth
        ex = r >= tl.load(row + C_MAX_LOOPS)
    else:
        lam = tl.load(lam_at)
        thr = tl.load(frow + C_THRESHOLD)
        at_max = r >= tl.load(row + C_MAX_LOOPS)
        past_min = r >= tl.load(row + C_MIN_LOOPS)
        gated = thr < 1.0
        if MODE == 2:  # random_lookahead: fire now, exit after one more loop
            fire = lam.to(tl.float64) >= thr
            ex = at_max | (gated & pending & past_min)
            pend2 = tl.where(gated, pending | fire, pending)
        else:
            rem2 = tl.where(gated, rem * (1.0 - lam), rem)  # fp32, as the reference
            decided = past_min & ((1.0 - rem2).to(tl.float64) >= thr)
            if MODE == 0:
                ex = at_max | (gated & decided)
            else:  # ouro_delayed: the decision after loop r applies after loop r+1
                ex = at_max | (gated & pending)
                pend2 = gated & decided
    return ex, rem2, pend2


@triton.jit
def _advance_kernel(
    idx_ptr,
    ints_ptr,
    floats_ptr,
    rem_ptr,
    trace_ptr,
    lam_ptr,
    tok_ptr,
    lp_ptr,
    slots_all_ptr,
    eos_ptr,
    rec_ptr,
    src_ptr,
    dst_ptr,
    stride_ints,
    stride_floats,
    stride_trace,
    stride_rec,
    num_eos,
    C_ACTIVE: tl.constexpr,
    C_TOKEN: tl.constexpr,
    C_POS: tl.constexpr,
    C_LOOP: tl.constexpr,
    C_NGEN: tl.constexpr,
    C_PENDING: tl.constexpr,
    C_MIN_LOOPS: tl.constexpr,
    C_MAX_LOOPS: tl.constexpr,
    C_MAX_TOKENS: tl.constexpr,
    C_MIN_TOKENS: tl.constexpr,
    C_IGNORE_EOS: tl.constexpr,
    C_TRACE_LEN: tl.constexpr,
    C_THRESHOLD: tl.constexpr,
    MODE: tl.constexpr,
    LAST_EXITED: tl.constexpr,
    T: tl.constexpr,
    T_PAD: tl.constexpr,
    EOS_PAD: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    s = tl.load(idx_ptr + i).to(tl.int64)
    row = ints_ptr + s * stride_ints
    active = tl.load(row + C_ACTIVE) > 0
    r = tl.load(row + C_LOOP)
    ngen0 = tl.load(row + C_NGEN)
    pending = tl.load(row + C_PENDING) > 0
    rem = tl.load(rem_ptr + s)
    ex, rem2, pend2 = exit_decision(
        row, floats_ptr + s * stride_floats, trace_ptr + s * stride_trace, rem, pending, lam_ptr + i, r, ngen0,
        C_MIN_LOOPS, C_MAX_LOOPS, C_TRACE_LEN, C_THRESHOLD, MODE,
    )  # fmt: skip
    ex = ex & active
    # An idle row keeps its state: a graph's masked rows include rows waiting to resume after a recompute.
    rem2 = tl.where(active, rem2, rem)
    pend2 = tl.where(active, pend2, pending)
    tok = tl.load(tok_ptr + i)
    lp = tl.load(lp_ptr + i)
    ngen = ngen0 + ex.to(tl.int64)
    e = tl.arange(0, EOS_PAD)
    eos = tl.load(eos_ptr + e, mask=e < num_eos, other=-1)
    is_eos = tl.sum(tl.where(eos == tok, 1, 0)) > 0
    eos_stop = is_eos & (tl.load(row + C_IGNORE_EOS) == 0) & (ngen >= tl.load(row + C_MIN_TOKENS))
    length_stop = ngen >= tl.load(row + C_MAX_TOKENS)
    tl.store(row + C_ACTIVE, (active & ~(ex & (eos_stop | length_stop))).to(tl.int64))
    tl.store(row + C_TOKEN, tl.where(ex, tok, tl.load(row + C_TOKEN)))
    tl.store(row + C_POS, tl.load(row + C_POS) + ex.to(tl.int64))
    tl.store(row + C_NGEN, ngen)
    tl.store(row + C_LOOP, tl.where(ex, 1, r + active.to(tl.int64)))
    tl.store(row + C_PENDING, (pend2 & ~ex).to(tl.int64))
    tl.store(rem_ptr + s, tl.where(ex, 1.0, rem2))
    # The record's emitted value: 0 none, 1 a token, 2 a token that stopped on EOS, 3 one that reached
    # max_tokens (the engine's EMIT_* values; EOS wins).
    code = tl.where(eos_stop, 2, tl.where(length_stop, 3, 1)) * ex.to(tl.int64)
    tl.store(rec_ptr + s, code.to(tl.float32))
    tl.store(rec_ptr + stride_rec + s, tok.to(tl.float32))
    tl.store(rec_ptr + 2 * stride_rec + s, r.to(tl.float32))
    tl.store(rec_ptr + 3 * stride_rec + s, lp)
    t = tl.arange(0, T_PAD).to(tl.int64)
    slots = tl.load(slots_all_ptr + i * T + t, mask=t < T, other=-1)
    src = tl.sum(tl.where(t == tl.minimum(tl.maximum(r - 1, 0), T - 1), slots, 0))
    if LAST_EXITED:
        fill = ex & (t >= r)
    else:
        fill = t < 0
    tl.store(src_ptr + i * T + t, tl.where(fill, src, -1), mask=t < T)
    tl.store(dst_ptr + i * T + t, tl.where(fill, slots, -1), mask=t < T)


def advance(
    state,
    idx: torch.Tensor,
    lam: torch.Tensor | None,
    tok: torch.Tensor,
    lp: torch.Tensor,
    slots_all: torch.Tensor,
    eos: torch.Tensor,
    rec: torch.Tensor,
    mode: ExitMode,
    last_exited: bool,
    cols: Mapping[str, int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """After the loop: exits, next steps and the record; returns the LAST_EXITED fill's (src, dst) slots."""
    S, T = idx.shape[0], state.num_loops
    src = torch.empty(S, T, dtype=torch.int64, device=idx.device)
    dst = torch.empty_like(src)
    assert rec.dim() == 2 and rec.stride(1) == 1 and lp.dtype == torch.float32, (rec.shape, lp.dtype)
    _advance_kernel[(S,)](
        idx,
        state.ints,
        state.floats,
        state.remaining,
        state.trace,
        lp if lam is None else lam.float(),
        tok,
        lp,
        slots_all,
        eos,
        rec,
        src,
        dst,
        state.ints.stride(0),
        state.floats.stride(0),
        state.trace.stride(0),
        rec.stride(0),
        eos.shape[0],
        **{
            f"C_{name}": cols[name]
            for name in (
                "ACTIVE",
                "TOKEN",
                "POS",
                "LOOP",
                "NGEN",
                "PENDING",
                "MIN_LOOPS",
                "MAX_LOOPS",
                "MAX_TOKENS",
                "MIN_TOKENS",
                "IGNORE_EOS",
                "TRACE_LEN",
                "THRESHOLD",
            )
        },
        MODE=_MODES[ExitMode(mode)],
        LAST_EXITED=last_exited,
        T=T,
        T_PAD=next_pow2(T),
        EOS_PAD=next_pow2(eos.shape[0]),
        num_warps=1,
        enable_fp_fusion=False,
    )
    return src, dst
