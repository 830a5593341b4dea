"""Self-speculative decoding: Ouro's early loops draft, its later loops verify (docs/engine.md).

Loop t of token i depends only on loop t-1 of tokens <= i. So when each decode row drafts K tokens with
loops 1..d (each draft is the argmax of the LM head on the previous token's loop-d state), those loops
compute exactly the states and KV that full-depth decoding would compute for the same tokens. The verify
pass then carries all K+1 tokens of a row (the row's current token and its K drafts) through loops
d+1..T as one causal chunk, from the drafts' loop-d states, writing their deeper planes' KV. Its
full-depth argmax y_j is the true successor of token j; the step accepts the longest run of drafts equal
to it and emits y_0..y_n (the accepted drafts, then the correction or bonus token). Greedy output is
thus plain full-depth decoding's, token for token. KV written past the accepted frontier is rewritten
by the next step before anything reads it.

Sampling is coupled rather than rejection-sampled: plain decoding draws token k of a request as the
argmax of its filtered, tempered logits plus Gumbel noise that is a hash of (seed, k, vocab id)
(sampler.py). A draft for token k is drawn with that same noise from the draft's logits, and y_k with it
from the verify pass's logits, so y_k is exactly the token plain sampling would draw, and a draft is
accepted when both races pick the same token. Sampled output therefore equals plain sampling token for
token (so its distribution is plain sampling's, and a seeded request is the same alone, batched,
speculated or not); the price is an acceptance rate somewhat below rejection sampling's 1 - TV(p, q).

Everything happens on the device: the step's record holds each emitted token (rounds 0..K) and, in its
last round, how many drafts each row had accepted, for the host's statistics.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..model.attention import AttentionMetadata
from ..model.sampler import SamplerMode, sample, sample_tokens
from . import decode_state as ds, decode_step

if TYPE_CHECKING:
    from .model_runner import ModelRunner

# The speculative record's last round: per slot, accepted drafts (REC_TOKEN) and whether the row drafted
# (REC_DEPTH); its REC_EMITTED stays 0, so `collect` reads no token from it.
REC_ACCEPTED, REC_DRAFTED = ds.REC_TOKEN, ds.REC_DEPTH


class SpecPolicy:
    """When to speculate (docs/engine.md, "Automatic fallback"): a step of K drafts of d loops and a verify
    pass of T - d loops costs (K + 1) d + T - d loop passes over the batch, and emits E = 1 + a + ... + a^K
    tokens per row at acceptance rate a, where plain decoding spends T passes a token. While each pass is
    bound by reading the weights (few rows), the step pays when E T > (K + 1) d + T - d. So the engine
    speculates when the verify pass stays small (rows x (K + 1) <= max_verify_tokens) and the expected gain
    at the estimated acceptance exceeds 1. The estimate is an exponential average of each step's
    acceptance (a convex combination of numbers in [0, 1]: it cannot diverge), starting at 1 so the engine
    tries; while it does not speculate, every `probe_every`-th decode launch speculates to re-measure."""

    def __init__(self, K: int, d: int, T: int, auto: bool, max_verify_tokens: int, weight: float = 0.2,
                 probe_every: int = 16):
        self.K, self.d, self.T, self.auto = K, d, T, auto
        self.max_verify_tokens, self.weight, self.probe_every = max_verify_tokens, weight, probe_every
        self.acceptance = 1.0
        self._seen = (0, 0)  # drafted, accepted already folded into the estimate
        self._skipped = 0

    def expected_gain(self, a: float) -> float:
        tokens = sum(a ** i for i in range(self.K + 1))
        return tokens * self.T / ((self.K + 1) * self.d + self.T - self.d)

    def observe(self, drafted: int, accepted: int) -> None:
        """Cumulative counters (RunnerStats.spec_drafted / spec_accepted) after a launch was read."""
        new_d, new_a = drafted - self._seen[0], accepted - self._seen[1]
        if new_d > 0:
            self.acceptance += self.weight * (new_a / new_d - self.acceptance)
            self._seen = (drafted, accepted)

    def decide(self, rows: int) -> bool:
        if not self.auto:
            return True
        if rows * (self.K + 1) > self.max_verify_tokens:
            return False
        if self.expected_gain(self.acceptance) > 1.0:
            return True
        self._skipped += 1
        if self._skipped >= self.probe_every:
            self._skipped = 0
            return True
        return False


def mean_accepted_length(drafted: int, accepted: int, K: int) -> float:
    """Tokens emitted per row and speculative step (1 + accepted drafts), from draft counts; 0 if none."""
    return 1 + accepted * K / drafted if drafted else 0.0


def spec_record(state: ds.DecodeState, spec_tokens: int) -> torch.Tensor:
    return state.new_record(spec_tokens + 2)


@torch.inference_mode()
def spec_step(r: "ModelRunner", idx: torch.Tensor, K: int, d: int, rec: torch.Tensor,
              mode: SamplerMode = SamplerMode.GREEDY) -> torch.Tensor:
    """One speculative step for decode rows `idx` (slots); fills `rec` [K + 2, 4, slots] and returns the
    verify pass's logits [S * (K + 1), V]. Each row's current token is computed from loop 1 (rewriting the
    same KV), so a row that plain rounds left mid-token enters as well; every row leaves at loop 1."""
    st, model, kv, bs, T = r.state, r.model, r.kv.kv, r.kv.block_size, r.num_loops
    S = idx.shape[0]
    ints = st.ints.index_select(0, idx)
    active = ints[:, ds.ACTIVE] > 0
    pos0 = torch.where(active, ints[:, ds.POS], 0)
    max_k = r.max_model_len + K

    def kv_slots(pos: torch.Tensor, plane: int, rows: torch.Tensor) -> torch.Tensor:
        blocks = st.tables[rows, plane, pos // bs].long()
        return torch.where(active.repeat_interleave(pos.shape[0] // S), blocks * bs + pos % bs, -1)

    # Draft: token i at position pos0 + i runs loops 1..d; its loop-d state drafts token i + 1.
    toks, states = [ints[:, ds.TOKEN]], []
    single_cu = r.arange[: S + 1].int()
    for i in range(K + 1):
        pos = pos0 + i
        h = model.embed(toks[i])
        for t in range(d):
            meta = AttentionMetadata(single_cu, torch.where(active, pos + 1, 1).int(), st.tables[idx, t],
                                     kv_slots(pos, t, idx), max_seqlen_q=1, max_seqlen_k=max_k,
                                     cu_seqlens_q_host=list(range(S + 1)))
            h = model.loop(h, pos, meta, kv)
        states.append(h)
        if i < K:
            # Token i + 1 drawn as plain decoding would draw it (same noise), so verification can agree.
            toks.append(sample_tokens(model.logits(h), mode, *r.sampling_rows(idx, mode, i)))
    # Verify: the K + 1 tokens of each row as one causal chunk through loops d+1..T.
    n = K + 1
    offs = torch.arange(n, device=idx.device)
    pos_all = (pos0[:, None] + offs[None, :]).flatten()
    rows_all = idx.repeat_interleave(n)
    h = torch.stack(states, 1).flatten(0, 1)
    cu = (r.arange[: S + 1] * n).int()
    lens = torch.where(active, pos0 + n, n).int()
    lens_host = lens.tolist() if not getattr(model.backend, "graph_safe", False) else None
    for t in range(d, T):
        meta = AttentionMetadata(cu, lens, st.tables[idx, t], kv_slots(pos_all, t, rows_all), max_seqlen_q=n,
                                 max_seqlen_k=max_k, cu_seqlens_q_host=list(range(0, S * n + 1, n)),
                                 seq_lens_host=lens_host)
        h = model.loop(h, pos_all, meta, kv)
    logits = model.logits(h)
    y, lp = sample(logits, mode, *r.sampling_rows(rows_all, mode, offs.repeat(S)))
    y, lp = y.view(S, n), lp.view(S, n)
    drafts = torch.stack(toks[1:], 1) if K else y[:, :0]
    accepted = (drafts == y[:, :K]).long().cumprod(1).sum(1)  # the longest run of drafts that verified
    depth = torch.full((S,), T, dtype=torch.long, device=idx.device)
    ones, no = torch.ones(S, device=idx.device), torch.zeros(S, dtype=torch.bool, device=idx.device)
    for j in range(n):  # emit y_0 .. y_accepted, each through the same state update as plain decoding
        cur = st.ints.index_select(0, idx)
        live = cur[:, ds.ACTIVE] > 0
        decode_step.emit(st, idx, cur, live, live & (j <= accepted), y[:, j], lp[:, j], depth, ones, no, r.eos,
                         rec[j])
    st.ints[:, ds.LOOP].index_fill_(0, idx, 1)  # every row waits at loop 1 of its next token
    rec[n, REC_ACCEPTED].index_copy_(0, idx, (accepted * active).float())
    rec[n, REC_DRAFTED].index_copy_(0, idx, active.float())
    return logits
