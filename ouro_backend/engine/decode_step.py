"""The decode state machine around one loop. `fused=True` runs each step as one fused Triton kernel
(`kernels/decode_step.py`, the CUDA path); otherwise it runs here in torch (the CPU path, and the kernels'
twin: same results bit for bit).

`prepare` reads the decode rows' state (rows = slots `idx`) into the loop's inputs. `advance` runs after
the loop and the coda: the exit rule, each row's next step written back, the round's record, and the
(src, dst) slot pairs of the LAST_EXITED fill. `emit` is the state update both share with the rows whose
prompt finishes (they emit their first token).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..config import ExitMode
from . import decode_state as ds
from .decode_state import DecodeState
from .exit_policy import ExitInputs, exit_rule


@dataclass
class DecodeInputs:
    pos: torch.Tensor  # int64 [S]: each row's position (0 for idle rows)
    slot: torch.Tensor  # int64 [S]: where this loop's K/V goes, -1 for idle rows
    seq_lens: torch.Tensor  # int32 [S]
    tables: torch.Tensor  # int32 [S, max_blocks]: the block table of this loop's plane
    h: torch.Tensor  # [S, H]: the token's embedding at loop 1, else the hidden state left by the last loop
    slots_all: torch.Tensor  # int64 [S, T]: the KV slot of pos in every plane


def _kernels():
    from ..kernels import decode_step  # imports Triton: only on the fused path

    return decode_step


def prepare(state: DecodeState, idx: torch.Tensor, embed: torch.Tensor, block_size: int,
            last_exited: bool, fused: bool = False) -> DecodeInputs:
    if fused:
        return DecodeInputs(*_kernels().prepare(state, idx, embed, block_size, last_exited, ds.COLUMNS))
    T = state.num_loops
    ints = state.ints.index_select(0, idx)
    active = ints[:, ds.ACTIVE] > 0
    pos = torch.where(active, ints[:, ds.POS], 0)
    loop = ints[:, ds.LOOP]
    slots_all = state.slots_at(idx, pos, block_size)
    plane = (loop - 1).clamp(0, T - 1) if last_exited else torch.full_like(loop, T - 1)
    slot = torch.where(active, slots_all.gather(1, plane[:, None])[:, 0], -1)
    h = torch.where((loop == 1)[:, None], embed[ints[:, ds.TOKEN]], state.hidden.index_select(0, idx))
    return DecodeInputs(pos, slot, torch.where(active, pos + 1, 1).int(), state.tables[idx, plane], h, slots_all)


def advance(state: DecodeState, idx: torch.Tensor, lam: Optional[torch.Tensor], tok: torch.Tensor,
            lp: torch.Tensor, slots_all: torch.Tensor, eos: torch.Tensor, rec: torch.Tensor, mode: ExitMode,
            last_exited: bool, fused: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """After loop r: exits, next steps and the record; returns the LAST_EXITED fill's (src, dst) slots
    [S, T] (-1: nothing to copy)."""
    if fused:
        return _kernels().advance(state, idx, lam, tok, lp, slots_all, eos, rec, mode, last_exited, ds.COLUMNS)
    T = state.num_loops
    ints = state.ints.index_select(0, idx)
    active = ints[:, ds.ACTIVE] > 0
    loop = ints[:, ds.LOOP]
    x = ExitInputs(loop, state.remaining.index_select(0, idx), ints[:, ds.PENDING] > 0, ints[:, ds.MIN_LOOPS],
                   ints[:, ds.MAX_LOOPS], state.floats.index_select(0, idx)[:, ds.THRESHOLD],
                   state.trace_depth(ints, idx) if mode is ExitMode.TRACE else None)
    exit_now, remaining, pending = exit_rule(mode, x, lam)
    exit_now = exit_now & active
    # An idle row keeps its state: a graph's masked rows include rows waiting to resume after a recompute.
    remaining = torch.where(active, remaining, x.remaining)
    pending = torch.where(active, pending, x.pending)
    emit(state, idx, ints, active, exit_now, tok, lp, loop, remaining, pending, eos, rec)
    # The exit plane's KV of this position goes into the deeper planes (LAST_EXITED).
    fill = exit_now[:, None] & (torch.arange(T, device=idx.device)[None, :] >= loop[:, None]) & last_exited
    src = slots_all.gather(1, (loop - 1).clamp(0, T - 1)[:, None]).expand(-1, T)
    return torch.where(fill, src, -1), torch.where(fill, slots_all, -1)


def emit(state: DecodeState, idx: torch.Tensor, ints: torch.Tensor, active: torch.Tensor, emit: torch.Tensor,
         tok: torch.Tensor, lp: torch.Tensor, depth: torch.Tensor, remaining: torch.Tensor, pending: torch.Tensor,
         eos: torch.Tensor, rec: torch.Tensor) -> None:
    """Record the emitting rows' tokens and write every row's next step: loop r+1 of the same token, or
    loop 1 of the next one; a request that reaches max_tokens or EOS goes idle. `eos` holds -1 for none."""
    ngen = ints[:, ds.NGEN] + emit.long()
    is_eos = (tok[:, None] == eos[None, :]).any(-1)
    stop = (ngen >= ints[:, ds.MAX_TOKENS]) | (is_eos & (ints[:, ds.IGNORE_EOS] == 0) & (ngen >= ints[:, ds.MIN_TOKENS]))
    changed = {
        ds.ACTIVE: (active & ~(emit & stop)).long(),
        ds.TOKEN: torch.where(emit, tok, ints[:, ds.TOKEN]),
        ds.POS: ints[:, ds.POS] + emit.long(),
        ds.NGEN: ngen,
        ds.LOOP: torch.where(emit, 1, ints[:, ds.LOOP] + active.long()),
        ds.PENDING: (pending & ~emit).long(),
    }
    # One write of whole rows (a stack of column views) instead of a clone and a write per column.
    state.ints.index_copy_(0, idx, torch.stack([changed.get(c, ints[:, c]) for c in range(ds.NUM_INTS)], dim=1))
    state.remaining.index_copy_(0, idx, torch.where(emit, 1.0, remaining))
    rec.index_copy_(1, idx, torch.stack([emit.float(), tok.float(), depth.float(), lp.float()]))
