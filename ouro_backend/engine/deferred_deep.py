"""Deferred deep batching (`deferred_deep_interval` B > 0; docs/engine.md): the round-side rules.

Readout at loop r (`deferred_readout_loop`); loops r+1..T are the deep loops. Output token k (token 0 is
the prompt's, at full depth) is a **boundary** token when k % B == 0. A decode row runs loops 1..r for its
token; at loop r:

* deferred: its loop-r output is retained (slot-local, one entry per position since the last boundary). A
  non-boundary token is read out there and the row moves on (its row's `MAX_LOOPS` is r). At a boundary
  the row **waits**: it goes idle and its record says `EMIT_DEEP`; the host then runs the request's last B
  positions through loops r+1..T as one chunk (a `PrefillChunk` with `deep=True`, from the retained
  states), which writes their true deep KV and reads the boundary token out at loop T
  (`DecodeState.emit_first`).
* eager (`deferred_deep_eager`, the control): the row runs all T loops for every token; a non-boundary
  token is sampled at loop r, held, and emitted at loop T with depth r. Same tokens, deep rows one per row.

Everything here is tensor work on the decode rows (graph-safe: no host reads). The noise counter of a
token is its row's `NGEN`, the same at every loop of the token, so a token sampled at loop r (or at the
deep chunk's loop T) is the same draw alone or in any batch.

NOTE: this class owns `retained` and the held readouts; `DecodeState` stays the only writer of the rows
(`park`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import decode_state as ds
from .decode_state import DecodeState


@dataclass(frozen=True)
class DeferredDeepConfig:
    interval: int  # B
    readout_loop: int  # r
    eager: bool = False


class DeferredDeep:
    def __init__(self, cfg: DeferredDeepConfig, state: DecodeState, hidden_size: int, dtype: torch.dtype):
        self.B, self.r, self.T, self.eager = cfg.interval, cfg.readout_loop, state.num_loops, cfg.eager
        assert 1 <= self.r < self.T and self.B >= 1
        n, dev = state.num_slots, state.device
        # Per slot, the loop-r outputs of the positions since the request's last boundary, in order.
        self.retained = None if self.eager else torch.zeros(n, self.B, hidden_size, dtype=dtype, device=dev)
        # eager: per slot, the token sampled at loop r and its logprob, emitted at loop T.
        self.held_tok = torch.zeros(n, dtype=torch.long, device=dev) if self.eager else None
        self.held_lp = torch.zeros(n, dtype=torch.float32, device=dev) if self.eager else None

    def row_max_loops(self) -> int:
        """The `MAX_LOOPS` every decode row runs to."""
        return self.T if self.eager else self.r

    def before_advance(
        self, state: DecodeState, idx: torch.Tensor, out: torch.Tensor, tok: torch.Tensor, lp: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """After the loop and the coda of decode rows `idx`, before `DecodeState.advance`: returns the tokens
        and logprobs `advance` must emit and the rows whose record gets this mode's mark (deferred: the rows
        that wait for their deep chunk, now idle; eager: the rows that emit a loop-r readout at loop T)."""
        ints = state.ints.index_select(0, idx)
        active, loop, ngen = ints[:, ds.ACTIVE] > 0, ints[:, ds.LOOP], ints[:, ds.NGEN]
        boundary = ngen % self.B == 0
        if self.eager:
            assert self.held_tok is not None and self.held_lp is not None
            hold = active & (loop == self.r) & ~boundary
            held_tok = torch.where(hold, tok, self.held_tok.index_select(0, idx))
            held_lp = torch.where(hold, lp.float(), self.held_lp.index_select(0, idx))
            self.held_tok.index_copy_(0, idx, held_tok)
            self.held_lp.index_copy_(0, idx, held_lp)
            late = active & (loop == self.T) & ~boundary  # (r < T: never a row that holds this round)
            return torch.where(late, held_tok, tok), torch.where(late, held_lp.to(lp.dtype), lp), late
        assert self.retained is not None
        readout = active & (loop == self.r)
        # NOTE: the position of token NGEN's input is the ((NGEN - 1) % B)-th since the last boundary.
        j = (ngen - 1).clamp_min(0) % self.B
        kept = self.retained[idx, j]
        self.retained[idx, j] = torch.where(readout[:, None], out.to(kept.dtype), kept)
        wait = readout & boundary
        state.park(idx, wait)
        return tok, lp, wait

    def after_advance(self, idx: torch.Tensor, marked: torch.Tensor, rec: torch.Tensor) -> None:
        """Mark the record [4, slots] of the rows `before_advance` returned: eager, their depth is the readout
        loop r (they emitted at loop T); deferred, they emitted nothing but wait (`EMIT_DEEP`)."""
        row, value = (ds.REC_DEPTH, self.r) if self.eager else (ds.REC_EMITTED, ds.EMIT_DEEP)
        rec[row].index_copy_(0, idx, torch.where(marked, float(value), rec[row].index_select(0, idx)))

    def chunk_input(self, slot: int, n: int) -> torch.Tensor:
        """A deep chunk's input at loop r+1: the slot's retained states, oldest first."""
        assert self.retained is not None
        return self.retained[slot, :n]
