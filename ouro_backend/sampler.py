"""Token sampling for the coda rows of a round.

Each seeded request draws its noise from its own generator, one draw per token, so its tokens do not
depend on which other requests share the batch. Sampling is the exponential race (argmax p / E with
E ~ Exp(1)), which equals drawing from p and needs no host round-trip.
"""
from __future__ import annotations

from typing import Optional

import torch

from .sampling_params import SamplingParams


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token once the mass before it already reaches top_p (the top token always stays).
        drop = (cum - sorted_logits.softmax(-1)) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, idx, sorted_logits)
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[Optional[torch.Generator]]) -> tuple[torch.Tensor, torch.Tensor]:
    """logits fp32 [R, V] -> (tokens int64 [R], logprob of each token under the model's distribution
    fp32 [R]), on the logits' device: nothing is read back here."""
    logprobs = torch.log_softmax(logits, dim=-1)
    tokens = logits.argmax(-1)
    for r, p in enumerate(params):
        if p.temperature == 0.0:
            continue
        row = apply_top_k_top_p(logits[r] / p.temperature, p.top_k, p.top_p)
        noise = torch.empty_like(row).exponential_(generator=generators[r])
        tokens[r] = (row.softmax(-1) / noise).argmax()
    return tokens, logprobs.gather(-1, tokens[:, None])[:, 0]
