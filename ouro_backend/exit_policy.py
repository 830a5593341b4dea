"""When a decode token stops looping (DESIGN sections 1 and 3).

Each decode token carries an `ExitState`; after every loop r the policy updates it with that loop's
gate value and answers "exit now?". Prompt tokens never consult it: they always run all T loops.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from .config import ExitMode


@dataclass
class ExitState:
    remaining: float = 1.0  # prod(1 - lambda_r): probability of not having exited yet
    pending: bool = False  # ouro_delayed / random_lookahead: a decision waiting to apply next loop


@dataclass(frozen=True)
class ExitBounds:
    min_loops: int
    max_loops: int
    threshold: float
    trace_depth: Optional[int] = None  # exit_mode=trace: this token's depth


class ExitPolicy:
    def __init__(self, mode: ExitMode | str, hidden_size: int, seed: int, device: torch.device):
        self.mode = ExitMode(mode)
        self.lookahead_w: Optional[torch.Tensor] = None
        if self.mode is ExitMode.RANDOM_LOOKAHEAD:
            # An untrained, seeded Linear(hidden, 1): a runtime experiment for scheduling studies, not a
            # quality-preserving exit rule.
            g = torch.Generator().manual_seed(seed)
            bound = hidden_size ** -0.5
            self.lookahead_w = ((torch.rand(hidden_size + 1, generator=g) * 2 - 1) * bound).to(device)

    def gate_values(self, model, h: torch.Tensor) -> torch.Tensor:
        """fp32 [rows] gate values for the decode rows in h."""
        if self.mode is ExitMode.RANDOM_LOOKAHEAD:
            w = self.lookahead_w
            return torch.sigmoid(h.float() @ w[:-1] + w[-1])
        return model.gate(h)

    @property
    def needs_gate(self) -> bool:
        return self.mode not in (ExitMode.TRACE, ExitMode.FIXED)

    def decides_on_host(self, b: ExitBounds) -> bool:
        """True when this token's exits never read a gate value (so a round can be scheduled on before
        its gates are read back)."""
        return not self.needs_gate or b.threshold >= 1.0

    def step(self, state: ExitState, r: int, lam: float, b: ExitBounds) -> bool:
        """Update after loop r (1-based) with gate value lam; True if the token exits now."""
        if self.mode is ExitMode.TRACE:
            return r >= b.trace_depth
        if r >= b.max_loops:
            return True
        if self.mode is ExitMode.FIXED or b.threshold >= 1.0:
            return False
        if self.mode is ExitMode.RANDOM_LOOKAHEAD:
            exit_now = state.pending and r >= b.min_loops
            state.pending = state.pending or lam >= b.threshold
            return exit_now
        # fp32 like the reference implementation, so threshold crossings match it exactly.
        one = np.float32(1.0)
        state.remaining = float(np.float32(state.remaining) * (one - np.float32(lam)))
        decided = r >= b.min_loops and float(one - np.float32(state.remaining)) >= b.threshold
        if self.mode is ExitMode.OURO:
            return decided
        # ouro_delayed: the decision read after loop r takes effect after loop r+1.
        exit_now, state.pending = state.pending, decided
        return exit_now
