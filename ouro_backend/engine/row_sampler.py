"""Sampling decode rows with each request's own values (temperature, top-k, top-p, seed, penalties), read
from the decode state and the penalty state on the device (model/sampler.py has the sampler and its noise)."""

from __future__ import annotations

import torch

from ..model.sampler import SamplerMode, sample, sample_tokens, vocab_hashes
from .decode_state import DecodeState
from .penalties import PenaltyState


class RowSampler:
    def __init__(self, state: DecodeState, penalties: PenaltyState, vocab_size: int):
        self.state, self.penalties = state, penalties
        self.vocab_hash = vocab_hashes(vocab_size, state.device)

    def args(self, idx: torch.Tensor, mode: SamplerMode, offset: torch.Tensor | int = 0) -> tuple:
        """The sampler's per-row arguments of slots `idx` (none for GREEDY); the noise counter is the tokens
        each request generated so far + `offset`."""
        if mode is SamplerMode.GREEDY:
            return ()
        rows = (*self.state.sampling_rows(idx, offset), self.vocab_hash)
        return (*rows, *self.penalties.rows(idx)) if mode is SamplerMode.PENALIZE else rows

    def sample(
        self, idx: torch.Tensor, logits: torch.Tensor, mode: SamplerMode, offset: torch.Tensor | int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' next tokens and their logprobs."""
        return sample(logits, mode, *self.args(idx, mode, offset))

    def tokens(
        self, idx: torch.Tensor, logits: torch.Tensor, mode: SamplerMode, offset: torch.Tensor | int = 0
    ) -> torch.Tensor:
        """The rows' next tokens only."""
        return sample_tokens(logits, mode, *self.args(idx, mode, offset))
