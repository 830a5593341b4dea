"""Token sampling for the coda rows of a round, vectorised over rows and reproducible per request.

Sampling is the exponential race (argmax p / E with E ~ Exp(1)), which equals drawing from p. The noise
is counter-based: E for vocabulary entry v of a request's k-th token is a hash of (seed, k, v), so a
seeded request draws the same tokens alone or in any batch, eagerly or inside a CUDA graph, one round
per launch or several, with no generator state to carry and no per-row Python.
"""

from __future__ import annotations

import enum

import torch

_M32 = 0xFFFFFFFF


class SamplerMode(enum.IntEnum):
    GREEDY = 0  # every row has temperature 0: argmax only
    SAMPLE = 1  # some row samples (with per-row temperature, top-k and top-p)
    PENALIZE = 2  # some row has penalties or bad words: `apply_penalties`, `mask_bad_words`, then as SAMPLE


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for 0 <= x < 2^32 without int64 overflow (16-bit halves)."""
    lo = (x & 0xFFFF) * c
    hi = (((x >> 16) * c) & 0xFFFF) << 16
    return (lo + hi) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser: a bijection that spreads every input bit over the output."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def uniform_noise(seed: torch.Tensor, counter: torch.Tensor, vocab_hash: torch.Tensor) -> torch.Tensor:
    """fp32 [R, V] uniforms in (0, 1) from int64 seed [R], counter [R] and the vocabulary's own hashes."""
    key = _mix32((seed & _M32) ^ _mix32(((seed >> 32) & _M32) ^ _mix32(counter & _M32)))
    bits = _mix32(key[:, None] ^ vocab_hash[None, :]) >> 8  # 24 bits: exact in fp32
    return (bits.float() + 0.5) * (1.0 / (1 << 24))


def vocab_hashes(vocab_size: int, device: torch.device) -> torch.Tensor:
    return _mix32((torch.arange(vocab_size, dtype=torch.int64, device=device) * 0x9E3779B1) & _M32)


def filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask logits [R, V] outside each row's top-k (k <= 0: off), then outside its top-p nucleus of what
    is left (the top token always stays). A token tied with the last kept one is kept too."""
    V = logits.shape[-1]
    srt = logits.sort(dim=-1, descending=True).values
    k = torch.where((top_k > 0) & (top_k < V), top_k, V)
    in_k = torch.arange(V, device=logits.device)[None, :] < k[:, None]
    probs = srt.masked_fill(~in_k, float("-inf")).softmax(-1)
    # A token goes once the mass before it already reaches top_p (top_p = 1 keeps all: no rounding loss).
    p = top_p[:, None].to(probs.dtype)
    keep = in_k & (((probs.cumsum(-1) - probs) < p) | (p >= 1.0))
    last = (keep.sum(-1, keepdim=True) - 1).clamp_min(0)  # the top token always stays (idle rows too)
    cutoff = srt.gather(-1, last)
    return logits.masked_fill(logits < cutoff, float("-inf"))


def apply_penalties(
    logits: torch.Tensor,
    counts: torch.Tensor,
    prompt: torch.Tensor,
    repetition: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
) -> torch.Tensor:
    """vLLM's penalties on fp32 logits [R, V], in its order: a logit of a token in the prompt (bool `prompt`
    [R, V]) or the output (int `counts` [R, V]: occurrences) is divided by its row's repetition penalty when
    positive, else multiplied by it; then frequency x count and presence x (count > 0) are subtracted (the
    penalties are fp32 [R]). Neutral values (1, 0, 0) return the logits unchanged bit for bit."""
    in_output = counts > 0
    rep = repetition[:, None]
    logits = torch.where(prompt | in_output, torch.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - frequency[:, None] * counts.to(logits.dtype)
    return logits - presence[:, None] * in_output.to(logits.dtype)


def mask_bad_words(logits: torch.Tensor, bad: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
    """vLLM's bad words on logits [R, V]: `bad` int64 [R, W, L] holds each row's W token sequences
    right-aligned (negative ids pad them and fill unused ones), `tail` [R, L - 1] the row's last output
    tokens (negative before the first). A sequence's last token is masked (-inf) where the tail ends with
    the rest of it; a one-token sequence always."""
    prefix, last = bad[:, :, :-1], bad[:, :, -1]
    match = ((prefix == tail[:, None, :]) | (prefix < 0)).all(-1) & (last >= 0)
    hits = torch.zeros(logits.shape, dtype=torch.int32, device=logits.device)
    hits.scatter_add_(1, last.clamp_min(0), match.to(torch.int32))  # (an add: words may share a last token)
    return logits.masked_fill(hits > 0, float("-inf"))


def sample_tokens(
    logits: torch.Tensor,
    mode: SamplerMode,
    temperature: torch.Tensor | None = None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    seed: torch.Tensor | None = None,
    counter: torch.Tensor | None = None,
    vocab_hash: torch.Tensor | None = None,
    *penalties: torch.Tensor,
) -> torch.Tensor:
    """logits fp32 [R, V] -> tokens int64 [R]. GREEDY takes every row's argmax and needs no per-row values;
    SAMPLE draws for the rows with temperature > 0 (the per-row tensors are [R]); PENALIZE first applies
    `apply_penalties` and `mask_bad_words` (`penalties`: their arguments after the logits, in order), greedy
    rows included. Nothing is read back."""
    if mode is SamplerMode.PENALIZE:
        counts, prompt, repetition, presence, frequency, bad, tail = penalties
        logits = mask_bad_words(apply_penalties(logits, counts, prompt, repetition, presence, frequency), bad, tail)
    tokens = logits.argmax(-1)
    if mode is not SamplerMode.GREEDY:
        temp = temperature.float()
        scaled = filter_top_k_top_p(logits / torch.where(temp > 0, temp, 1.0)[:, None], top_k, top_p)
        race = scaled - torch.log(-torch.log(uniform_noise(seed, counter, vocab_hash)))
        tokens = torch.where(temp > 0, race.argmax(-1), tokens)
    return tokens


def sample(logits: torch.Tensor, mode: SamplerMode, *rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_tokens` (same arguments), and each token's logprob under the model's distribution (the logits
    before penalties, bad words, temperature, top-k and top-p, as vLLM's default raw logprobs), fp32 [R]."""
    tokens = sample_tokens(logits, mode, *rows)
    return tokens, torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None])[:, 0]
