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

import torch

from ..model.attention import AttentionMetadata
from ..model.ouro import OuroModel
from ..model.sampler import SamplerMode
from . import decode_state as ds
from .decode_state import DecodeState
from .kv_cache import KVCache
from .row_sampler import RowSampler

# The speculative record's last round: per slot, accepted drafts (REC_TOKEN) and whether the row drafted
# (REC_DEPTH); its REC_EMITTED stays 0, so `collect` reads no token from it.
REC_ACCEPTED, REC_DRAFTED = ds.REC_TOKEN, ds.REC_DEPTH


class Speculator:
    """Runs speculative steps of K drafts of `draft_loops` loops each over the decode state's rows."""

    def __init__(
        self,
        model: OuroModel,
        state: DecodeState,
        kv: KVCache,
        sampler: RowSampler,
        num_tokens: int,
        draft_loops: int,
        max_model_len: int,
    ):
        self.model, self.state, self.kv, self.sampler = model, state, kv, sampler
        self.K, self.d, self.num_loops = num_tokens, draft_loops, state.num_loops
        self.max_model_len = max_model_len
        self._arange = torch.arange(state.num_slots + 1, dtype=torch.int64, device=state.device)  # static: graphs

    @property
    def rounds(self) -> int:
        """Loops over all rows a step runs: K + 1 drafts of d loops, then the verify pass's T - d."""
        return (self.K + 1) * self.d + self.num_loops - self.d

    def new_record(self) -> torch.Tensor:
        """A step's record: rounds 0..K hold emitted tokens, round K + 1 the acceptance counts."""
        return self.state.new_record(self.K + 2)

    @torch.inference_mode()
    def step(self, idx: torch.Tensor, rec: torch.Tensor, mode: SamplerMode = SamplerMode.GREEDY) -> torch.Tensor:
        """One speculative step for decode rows `idx` (slots); fills `rec` [K + 2, 4, slots] and returns the
        verify pass's logits [S * (K + 1), V]. Each row's current token is computed from loop 1 (rewriting the
        same KV), so a row that plain rounds left mid-token enters as well; every row leaves at loop 1."""
        assert mode is not SamplerMode.PENALIZE  # the scheduler does not speculate penalized batches
        st, model, kv, bs, T, K, d = (
            self.state,
            self.model,
            self.kv.kv,
            self.kv.block_size,
            self.num_loops,
            self.K,
            self.d,
        )
        S = idx.shape[0]
        ints = st.ints.index_select(0, idx)
        active = ints[:, ds.ACTIVE] > 0
        pos0 = torch.where(active, ints[:, ds.POS], 0)
        max_k = self.max_model_len + K

        def kv_slots(pos: torch.Tensor, plane: int, rows: torch.Tensor) -> torch.Tensor:
            blocks = st.tables[rows, plane, pos // bs].long()
            return torch.where(active.repeat_interleave(pos.shape[0] // S), blocks * bs + pos % bs, -1)

        # Draft: token i at position pos0 + i runs loops 1..d; its loop-d state drafts token i + 1.
        toks, states = [ints[:, ds.TOKEN]], []
        single_cu = self._arange[: S + 1].int()
        for i in range(K + 1):
            pos = pos0 + i
            h = model.embed(toks[i])
            for t in range(d):
                meta = AttentionMetadata(
                    single_cu,
                    torch.where(active, pos + 1, 1).int(),
                    st.tables[idx, t],
                    kv_slots(pos, t, idx),
                    max_seqlen_q=1,
                    max_seqlen_k=max_k,
                    cu_seqlens_q_host=list(range(S + 1)),
                )
                h = model.loop(h, pos, meta, kv)
            states.append(h)
            if i < K:
                # Token i + 1 drawn as plain decoding would draw it (same noise), so verification can agree.
                toks.append(self.sampler.tokens(idx, model.logits(h), mode, i))
        # Verify: the K + 1 tokens of each row as one causal chunk through loops d+1..T.
        n = K + 1
        offs = torch.arange(n, device=idx.device)
        pos_all = (pos0[:, None] + offs[None, :]).flatten()
        rows_all = idx.repeat_interleave(n)
        h = torch.stack(states, 1).flatten(0, 1)
        cu = (self._arange[: S + 1] * n).int()
        lens = torch.where(active, pos0 + n, n).int()
        lens_host = lens.tolist() if not getattr(model.backend, "graph_safe", False) else None
        for t in range(d, T):
            meta = AttentionMetadata(
                cu,
                lens,
                st.tables[idx, t],
                kv_slots(pos_all, t, rows_all),
                max_seqlen_q=n,
                max_seqlen_k=max_k,
                cu_seqlens_q_host=list(range(0, S * n + 1, n)),
                seq_lens_host=lens_host,
            )
            h = model.loop(h, pos_all, meta, kv)
        logits = model.logits(h)
        y, lp = self.sampler.sample(rows_all, logits, mode, offs.repeat(S))
        y, lp = y.view(S, n), lp.view(S, n)
        drafts = torch.stack(toks[1:], 1) if K else y[:, :0]
        accepted = (drafts == y[:, :K]).long().cumprod(1).sum(1)  # the longest run of drafts that verified
        depth = torch.full((S,), T, dtype=torch.long, device=idx.device)
        ones, no = torch.ones(S, device=idx.device), torch.zeros(S, dtype=torch.bool, device=idx.device)
        for j in range(n):  # emit y_0 .. y_accepted, each through the same state update as plain decoding
            cur = st.ints.index_select(0, idx)
            live = cur[:, ds.ACTIVE] > 0
            st.emit(idx, cur, live, live & (j <= accepted), y[:, j], lp[:, j], depth, ones, no, rec[j])
        st.restart_at_loop_one(idx)
        rec[n, REC_ACCEPTED].index_copy_(0, idx, (accepted * active).float())
        rec[n, REC_DRAFTED].index_copy_(0, idx, active.float())
        return logits
