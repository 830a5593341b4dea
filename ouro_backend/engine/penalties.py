"""The device state behind repetition / presence / frequency penalties and bad words (docs/engine.md,
"Penalties and bad words").

Per engine slot: the request's three penalty values, which tokens its prompt holds, how often each token
occurs in its output so far, its bad words' token sequences and its last output tokens. The sampler reads
them (`rows`; model/sampler.py `apply_penalties`, `mask_bad_words`) only in SamplerMode.PENALIZE, which the
scheduler picks exactly while a running request has penalties or bad words; the rounds of such launches
count each emitted token and shift it into the row's tail (`record`), on the device, so none of it needs
host work per round either.

NOTE: this class is the only writer of its tensors. A row's values are neutral (1, 0, 0) unless a
penalized request holds the slot, and its bad words are none (-1 everywhere) unless a request with bad words
holds it; neutral values and no bad words leave logits bit for bit unchanged, so such a row samples exactly
as it would in SAMPLE mode whatever its stale counts and tail hold. Counts and tail are valid only while a
request that uses them holds the row: `admit` and `restore` rebuild them, `record` counts only penalized
rows (the tail of every row it is given).

Memory: num_slots x vocab x 5 bytes (int32 counts + bool prompt mask), e.g. 16 MB for 64 slots x 49k, and
num_slots x MAX_BAD_WORDS x MAX_BAD_WORD_TOKENS int64 bad-word ids (128 KB for 64 slots).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..sampling_params import MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS, SamplingParams

REP, PRES, FREQ = range(3)  # columns of `PenaltyState.values`
NEUTRAL = (1.0, 0.0, 0.0)
NO_TOKEN = -1  # bad-word padding, and the tail before the first output tokens: equal to no token id


@dataclass
class SavedPenalties:
    """A penalized row's device copies, for swapping its request out."""

    values: torch.Tensor
    counts: torch.Tensor
    prompt: torch.Tensor
    bad: torch.Tensor
    tail: torch.Tensor


class PenaltyState:
    def __init__(
        self,
        num_slots: int,
        vocab_size: int,
        device: torch.device,
        to_device: Callable[[list, torch.dtype], torch.Tensor],
    ):
        self.vocab_size, self.to_device = vocab_size, to_device
        self.values = torch.tensor([NEUTRAL] * num_slots, dtype=torch.float32, device=device)
        self.counts = torch.zeros(num_slots, vocab_size, dtype=torch.int32, device=device)
        self.prompt = torch.zeros(num_slots, vocab_size, dtype=torch.bool, device=device)
        # Bad words right-aligned in MAX_BAD_WORD_TOKENS columns, NO_TOKEN before them and in unused words; the
        # row's last MAX_BAD_WORD_TOKENS - 1 output tokens, newest last, NO_TOKEN before the first.
        L = MAX_BAD_WORD_TOKENS
        self.bad = torch.full((num_slots, MAX_BAD_WORDS, L), NO_TOKEN, dtype=torch.int64, device=device)
        self.tail = torch.full((num_slots, L - 1), NO_TOKEN, dtype=torch.int64, device=device)
        self._used: set[int] = set()  # slots with non-neutral values or bad words (host mirror)

    # ---- host writes (between launches, in stream order) ----
    def admit(
        self,
        slot: int,
        params: SamplingParams,
        prompt_ids: Sequence[int],
        output_ids: Sequence[int],
        bad_word_ids: Sequence[Sequence[int]] = (),
    ) -> None:
        """A request takes `slot`: its values, and if it processes logits its prompt mask, output counts,
        bad words and tail (`output_ids`: what it generated before a recompute preemption, else nothing)."""
        if not params.processes_logits:
            self._neutral(slot)
            return
        to, L = self.to_device, MAX_BAD_WORD_TOKENS
        p = params
        # float64 through the staging (it carries float64 bit patterns, not float32), rounded on the device
        self.values[slot] = to([p.repetition_penalty, p.presence_penalty, p.frequency_penalty], torch.float64)
        self.prompt[slot] = False
        self.prompt[slot, to(list(prompt_ids), torch.long)] = True
        self.counts[slot] = 0
        if output_ids:  # (an index_add: bincount would wait for the device to size its result)
            out = to(list(output_ids), torch.long)
            self.counts[slot].index_add_(0, out, torch.ones_like(out, dtype=torch.int32))
        words = [[NO_TOKEN] * (L - len(w)) + list(w) for w in bad_word_ids]  # add_request checked the limits
        words += [[NO_TOKEN] * L] * (MAX_BAD_WORDS - len(words))
        self.bad[slot] = to([t for w in words for t in w], torch.long).view(MAX_BAD_WORDS, L)
        tail = list(output_ids[-(L - 1) :])
        self.tail[slot] = to([NO_TOKEN] * (L - 1 - len(tail)) + tail, torch.long)
        self._used.add(slot)

    def save(self, slot: int) -> SavedPenalties | None:
        if slot not in self._used:
            return None
        return SavedPenalties(*(t[slot].clone() for t in (self.values, self.counts, self.prompt, self.bad, self.tail)))

    def restore(self, slot: int, saved: SavedPenalties | None) -> None:
        """Write a saved row back at `slot` (None: the request processes no logits)."""
        if saved is None:
            self._neutral(slot)
            return
        self.values[slot] = saved.values
        self.counts[slot] = saved.counts
        self.prompt[slot] = saved.prompt
        self.bad[slot] = saved.bad
        self.tail[slot] = saved.tail
        self._used.add(slot)

    def _neutral(self, slot: int) -> None:
        if slot in self._used:
            self.values[slot] = self.to_device(list(NEUTRAL), torch.float64)
            self.bad[slot] = NO_TOKEN
            self._used.discard(slot)

    # ---- the rounds (eager, or inside a CUDA graph) ----
    def rows(self, idx: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The sampler's PENALIZE arguments of slots `idx`: output counts, prompt mask, the repetition,
        presence and frequency penalties (model/sampler.py `apply_penalties`), bad words and tail
        (`mask_bad_words`)."""
        v = self.values.index_select(0, idx)
        return (
            self.counts.index_select(0, idx),
            self.prompt.index_select(0, idx),
            v[:, REP],
            v[:, PRES],
            v[:, FREQ],
            self.bad.index_select(0, idx),
            self.tail.index_select(0, idx),
        )

    def record(self, idx: torch.Tensor, tok: torch.Tensor, emitted: torch.Tensor) -> None:
        """Rows idx[i] that emitted[i] token tok[i]: count it where the row is penalized, and shift it into
        the row's tail. `idx` holds distinct slots, so a gather and a copy (no accumulating scatter) do it."""
        v = self.values.index_select(0, idx)
        penalized = (v[:, REP] != 1.0) | (v[:, PRES] != 0.0) | (v[:, FREQ] != 0.0)
        flat = idx * self.vocab_size + tok
        counts = self.counts.view(-1)
        counts.index_copy_(0, flat, counts.index_select(0, flat) + (emitted & penalized).to(torch.int32))
        tail = self.tail.index_select(0, idx)
        shifted = torch.cat([tail[:, 1:], tok[:, None]], dim=1)
        self.tail.index_copy_(0, idx, torch.where(emitted[:, None], shifted, tail))
