"""Runs one recurrent round: the rows the scheduler picked, each one loop deeper.

Prelude (embed rows entering loop 1) -> one loop over all rows -> exit check for decode rows ->
LAST_EXITED exit fill -> coda (LM head + sampling) for rows that finished their last loop.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .attention import AttentionMetadata
from .exit_policy import ExitPolicy
from .kv_cache import KVCache
from .model import OuroModel
from .sampler import sample
from .sequence import Sequence


@dataclass
class Emitted:
    seq: Sequence
    token: int
    logprob: float
    depth: int
    logits: Optional[torch.Tensor] = None  # only when the runner records logits (tests, debugging)


class ModelRunner:
    def __init__(self, model: OuroModel, kv: KVCache, policy: ExitPolicy):
        self.model = model
        self.kv = kv
        self.policy = policy
        self.num_loops = model.cfg.total_ut_steps
        self.device = model.device
        self.rows_run = 0
        self.tokens_run = 0
        self.record_logits = False

    def _plane(self, seq: Sequence) -> int:
        item = seq.item
        return item.loop - 1 if item.is_prefill else self.kv.decode_plane(item.loop)

    def _prepare(self, batch: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        kv, dev = self.kv, self.device
        cu, lens, positions, slots, tables, parts = [0], [], [], [], [], []
        embed_ids, embed_at = [], []
        for seq in batch:
            item = seq.item
            table = seq.block_tables[self._plane(seq)]
            pos = range(item.start, item.start + item.n)
            positions.extend(pos)
            slots.extend(kv.slot(table, p) for p in pos)
            cu.append(cu[-1] + item.n)
            lens.append(item.start + item.n)
            tables.append(table)
            if item.hidden is None:
                embed_at.append(len(parts))
                embed_ids.extend(seq.all_ids[item.start: item.start + item.n])
                parts.append(item.n)
            else:
                parts.append(item.hidden)
        if embed_ids:
            emb = self.model.embed(torch.tensor(embed_ids, device=dev)).split([parts[i] for i in embed_at])
            for i, e in zip(embed_at, emb):
                parts[i] = e
        width = max(len(t) for t in tables)
        table_t = torch.zeros(len(tables), width, dtype=torch.int32)
        for r, t in enumerate(tables):
            table_t[r, : len(t)] = torch.tensor(t, dtype=torch.int32)
        meta = AttentionMetadata(
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            block_tables=table_t.to(dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            max_seqlen_q=max(cu[i + 1] - cu[i] for i in range(len(batch))),
            max_seqlen_k=max(lens), cu_seqlens_q_host=cu, seq_lens_host=lens)
        return torch.cat(parts), torch.tensor(positions, device=dev), meta

    @torch.inference_mode()
    def run(self, batch: list[Sequence]) -> list[Emitted]:
        h, positions, meta = self._prepare(batch)
        out = self.model.loop(h, positions, meta, self.kv.kv)
        self.rows_run += len(batch)
        self.tokens_run += h.shape[0]

        cu = meta.cu_seqlens_q_host
        decode_rows = [r for r, s in enumerate(batch) if not s.item.is_prefill]
        lams = []
        if decode_rows and self.policy.needs_gate:
            idx = torch.tensor([cu[r] for r in decode_rows], device=self.device)
            lams = self.policy.gate_values(self.model, out[idx]).tolist()
        lam_of = dict(zip(decode_rows, lams))

        coda_rows, coda, fill = [], [], []
        for r, seq in enumerate(batch):
            item = seq.item
            done_loop = item.loop
            item.hidden = out[cu[r]: cu[r + 1]]
            item.loop += 1
            if item.is_prefill:
                if done_loop < self.num_loops:
                    continue
                seq.num_prefilled = item.start + item.n
                seq.item = None
                if seq.in_prefill:
                    continue  # more prompt chunks to come
                self.kv.release_prefill_planes(seq.block_tables)
                coda_rows.append(cu[r + 1] - 1)
                coda.append((seq, done_loop))
            elif self.policy.step(item.exit_state, done_loop, lam_of.get(r, 0.0), item.bounds):
                fill += self.kv.exit_fill_slots(seq.block_tables, item.start, done_loop)
                seq.item = None
                coda_rows.append(cu[r])
                coda.append((seq, done_loop))
        if fill:
            src, dst = zip(*fill)
            self.model.backend.copy_kv_slots(self.kv.kv, torch.tensor(src, device=self.device),
                                             torch.tensor(dst, device=self.device))
        if not coda:
            return []
        logits = self.model.logits(out[torch.tensor(coda_rows, device=self.device)])
        seqs = [s for s, _ in coda]
        tokens, logprobs = sample(logits, [s.params for s in seqs], [s.generator for s in seqs])
        rec = logits.cpu() if self.record_logits else [None] * len(seqs)
        return [Emitted(s, t, lp, d, lg) for (s, d), t, lp, lg in zip(coda, tokens, logprobs, rec)]
