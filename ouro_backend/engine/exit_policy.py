"""When a decode token stops looping (docs/engine.md, "Exit rules"), decided on the device for a whole round.

After loop r every decode row has a gate value (`ExitPolicy.gate_values`); `exit_rule` turns the rows'
loop, gate and carried state into "exit now?" plus the state to carry into loop r+1, as tensor
arithmetic, so no row's decision needs the host. Prompt tokens never consult it: they always run all T loops.

The hazard is accumulated in fp32 exactly as the reference implementation does
(`remaining *= 1 - lambda`, `cdf = 1 - remaining`), and `cdf` is compared with the request's threshold
in float64 (the threshold is a Python float), so threshold crossings match the dense oracle bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import ExitMode


@dataclass
class ExitInputs:
    """Per decode row (all tensors of one length): where the row is and what it carries."""

    loop: torch.Tensor  # int64: the loop just run (1-based)
    remaining: torch.Tensor  # fp32: prod(1 - lambda) over the earlier loops of this token
    pending: torch.Tensor  # bool: ouro_delayed / random_lookahead decision waiting to apply
    min_loops: torch.Tensor  # int64
    max_loops: torch.Tensor  # int64
    threshold: torch.Tensor  # float64; >= 1 means fixed depth max_loops
    trace_depth: torch.Tensor | None = None  # int64, exit_mode=trace: this token's depth


class ExitPolicy:
    def __init__(self, mode: ExitMode | str, hidden_size: int, seed: int, device: torch.device):
        self.mode = ExitMode(mode)
        self.lookahead_w: torch.Tensor | None = None
        if self.mode is ExitMode.RANDOM_LOOKAHEAD:
            # An untrained, seeded Linear(hidden, 1): a runtime experiment for scheduling studies, not a
            # quality-preserving exit rule.
            g = torch.Generator().manual_seed(seed)
            bound = hidden_size**-0.5
            self.lookahead_w = ((torch.rand(hidden_size + 1, generator=g) * 2 - 1) * bound).to(device)

    @property
    def needs_gate(self) -> bool:
        return self.mode not in (ExitMode.TRACE, ExitMode.FIXED)

    def gate_values(self, model, h: torch.Tensor) -> torch.Tensor:
        """fp32 [rows] gate values for the rows of h."""
        if self.mode is ExitMode.RANDOM_LOOKAHEAD:
            w = self.lookahead_w
            assert w is not None  # set in __init__ for this mode
            return torch.sigmoid(h.float() @ w[:-1] + w[-1])
        return model.gate(h)


def exit_rule(
    mode: ExitMode, x: ExitInputs, lam: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(exit now, remaining, pending) after loop `x.loop` with gate values `lam` (None when the mode reads
    no gate). The returned state is what loop r+1 carries; a row that exits starts afresh."""
    r = x.loop
    if mode is ExitMode.TRACE:
        assert x.trace_depth is not None  # the trace mode's inputs carry it
        return r >= x.trace_depth, x.remaining, x.pending
    at_max = r >= x.max_loops
    if mode is ExitMode.FIXED:
        return at_max, x.remaining, x.pending
    gated = x.threshold < 1.0
    assert lam is not None  # the gated modes read the gate (ExitPolicy.needs_gate)
    if mode is ExitMode.RANDOM_LOOKAHEAD:
        fire = lam.double() >= x.threshold
        exit_now = at_max | (gated & x.pending & (r >= x.min_loops))
        return exit_now, x.remaining, torch.where(gated, x.pending | fire, x.pending)
    remaining = torch.where(gated, x.remaining * (1.0 - lam.float()), x.remaining)
    decided = (r >= x.min_loops) & ((1.0 - remaining).double() >= x.threshold)
    if mode is ExitMode.OURO:
        return at_max | (gated & decided), remaining, x.pending
    # ouro_delayed: the decision read after loop r takes effect after loop r+1.
    return at_max | (gated & x.pending), remaining, gated & decided
