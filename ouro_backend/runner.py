"""Runs one recurrent round: the rows the scheduler picked, each one loop deeper.

Prelude (embed rows entering loop 1) -> one loop over all rows -> exit check for decode rows ->
LAST_EXITED exit fill -> coda (LM head + sampling) for rows that finished their last loop.

`launch` enqueues a round and returns at once unless an exit needs this round's gate values; the
sampled tokens stay on the device (the next round's prelude embeds them from there) and are copied
back asynchronously. `collect` waits for that copy. The engine launches round N+1 before collecting
round N, so the host's bookkeeping overlaps the GPU (DESIGN section 4).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .attention import AttentionMetadata
from .exit_policy import ExitPolicy
from .kv_cache import KVCache
from .model import OuroModel
from .sampler import sample
from .sequence import Sequence


@dataclass
class Round:
    """A launched round's emitted rows and where their sampled tokens land."""
    emits: list[tuple[Sequence, int]]  # (sequence, exit depth) per emitted row
    host: Optional[torch.Tensor] = None  # [2, E] fp32 token ids and logprobs, filled once `ready` fires
    ready: Optional[torch.cuda.Event] = None
    logits: Optional[torch.Tensor] = None  # only when the runner records logits


@dataclass
class Emitted:
    seq: Sequence
    token: int
    logprob: float
    depth: int
    logits: Optional[torch.Tensor] = None  # only when the runner records logits (tests, debugging)


class HostStaging:
    """Persistent pinned buffers for a round's small host<->device transfers.

    Pinning fresh tensors every round is slow (page-locked allocations); instead each round bump-allocates
    from one of two pinned halves, and an event guards a half until the copies that use it have run. A
    half also holds the round's read-back, which the engine collects before the half comes round again.
    """

    def __init__(self, device: torch.device, size: int = 1 << 20):
        self.device = device
        self.halves = [torch.empty(size, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        self.views = [h.numpy() for h in self.halves]
        self.back = [torch.empty(size // 8, dtype=torch.float32, pin_memory=True) for _ in range(2)]
        self.events = [None, None]
        self.cur, self.off, self.back_off = 0, 0, 0

    def next_round(self) -> None:
        ev = torch.cuda.Event()
        ev.record()
        self.events[self.cur] = ev
        self.cur ^= 1
        self.off = self.back_off = 0
        if self.events[self.cur] is not None:
            self.events[self.cur].synchronize()

    def put(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        n = len(data)
        if self.off + n > self.views[self.cur].shape[0]:
            return torch.tensor(data, dtype=dtype).to(self.device)  # oversized: plain (synchronous) copy
        self.views[self.cur][self.off: self.off + n] = data
        host = self.halves[self.cur][self.off: self.off + n]
        self.off += n
        dev = host.to(self.device, non_blocking=True)
        return dev if dtype == torch.int64 else dev.to(dtype)

    def readback(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
        """Start copying fp32 device tensor t to pinned host memory; returns the host tensor and an event
        that fires once it is filled."""
        n = t.numel()
        if self.back_off + n > self.back[self.cur].shape[0]:
            host = torch.empty(t.shape, dtype=torch.float32, pin_memory=True)  # oversized
        else:
            host = self.back[self.cur][self.back_off: self.back_off + n].view(t.shape)
            self.back_off += n
        host.copy_(t, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return host, ready


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    out: torch.Tensor  # [tokens, H] loop output
    gate: torch.Tensor  # [tokens] gate values
    tokens: int
    rows: int
    # Decode graphs also run the greedy coda for every row, so a round needs a single readback:
    # packed = [gate, argmax token, its logprob] per row, and the logits for rows that sample.
    packed: Optional[torch.Tensor] = None
    logits: Optional[torch.Tensor] = None


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
        self.decode_graphs: dict[int, _Graph] = {}  # rows -> graph of decode rounds (one token a row)
        self.mixed_graphs: dict[int, _Graph] = {}  # tokens -> graph of rounds with prompt chunks
        self.graph_memory = 0
        self.graph_rounds = self.eager_rounds = 0
        self.last_round: dict[str, int] = {}
        # Host work to do while the GPU runs a round's loop (the engine process sends the previous step's
        # outputs here). It must not call into the engine.
        self.overlap: Optional[Callable[[], None]] = None
        self.staging = HostStaging(self.device) if self.device.type == "cuda" else None

    def _to_dev(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        """A flat host list on the device without a device sync (pinned staging on CUDA)."""
        if self.staging is None:
            return torch.tensor(data, dtype=dtype)
        return self.staging.put(data, dtype)

    def _to_dev_2d(self, rows: list[list[int]], width: int, dtype: torch.dtype) -> torch.Tensor:
        flat = [x for row in rows for x in row + [0] * (width - len(row))]
        return self._to_dev(flat, dtype).view(len(rows), width)

    def _plane(self, seq: Sequence) -> int:
        item = seq.item
        return item.loop - 1 if item.is_prefill else self.kv.decode_plane(item.loop)

    def _metadata(self, batch: list[Sequence]) -> tuple[list[int], list[int], list[int], list[int], list[list[int]]]:
        """Host metadata of a round: positions, slots, cu_seqlens_q, seq_lens, block tables (unpadded)."""
        bs = self.kv.block_size
        positions, slots, cu, lens, tables = [], [], [0], [], []
        for seq in batch:
            item = seq.item
            table = seq.block_tables[self._plane(seq)]
            start = item.start
            end = start + item.n
            if item.n == 1:  # decode rows: most rows of most rounds
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                positions.extend(range(start, end))
                slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            cu.append(end - start + cu[-1])
            lens.append(end)
            tables.append(table[: -(-end // bs)])
        return positions, slots, cu, lens, tables

    def _gather_inputs(self, batch: list[Sequence]) -> torch.Tensor:
        """The round's input rows in batch order: embeddings for rows entering loop 1 (token ids from the
        host, or still on the device for a token not read back yet), else the rows of the previous round's
        output they left off at. One embedding call and one gather."""
        ids, on_device, sources, index = [], {}, {}, []
        for seq in batch:
            item = seq.item
            if item.src is not None:
                index.append((sources.setdefault(id(item.src), item.src), item.src_row, item.n))
            elif item.token_src is not None:  # a decode item: n == 1
                t, i = item.token_src
                group = on_device.setdefault(id(t), (t, []))[1]
                index.append((t, len(group), 1))
                group.append(i)
            else:
                index.append((None, len(ids), item.n))
                ids.extend(seq.token_ids(item.start, item.start + item.n))
        offsets = {None: 0}
        token_parts = [self._to_dev(ids, torch.long)] if ids else []
        base = len(ids)
        for key, (t, idx) in on_device.items():
            offsets[key] = base
            base += len(idx)
            token_parts.append(t[0].index_select(0, self._to_dev(idx, torch.long)).long())
        pool = [self.model.embed(token_parts[0] if len(token_parts) == 1 else torch.cat(token_parts))] if base else []
        for key, src in sources.items():
            offsets[key] = base
            base += src.shape[0]
            pool.append(src)
        rows = [offsets[None if src is None else id(src)] + row + i for src, row, n in index for i in range(n)]
        pool_t = pool[0] if len(pool) == 1 else torch.cat(pool)
        return pool_t.index_select(0, self._to_dev(rows, torch.long))

    def _prepare(self, batch: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        positions, slots, cu, lens, tables = self._metadata(batch)
        width = max(len(t) for t in tables)
        meta = AttentionMetadata(
            cu_seqlens_q=self._to_dev(cu, torch.int32), seq_lens=self._to_dev(lens, torch.int32),
            block_tables=self._to_dev_2d(tables, width, torch.int32),
            slot_mapping=self._to_dev(slots, torch.int64),
            max_seqlen_q=max(cu[i + 1] - cu[i] for i in range(len(batch))),
            max_seqlen_k=max(lens), cu_seqlens_q_host=cu, seq_lens_host=lens)
        return self._gather_inputs(batch), self._to_dev(positions, torch.long), meta

    # ---- CUDA graphs ----
    @torch.inference_mode()
    def capture_graphs(self, max_rows: int, max_model_len: int, max_graph_tokens: int) -> None:
        """Capture the recurrent core (+ gate): decode rounds per row bucket (one query a row), and
        rounds with prompt chunks per token bucket (up to max_rows rows). Pad rows and pad tokens get
        slot -1 (no KV write); pad rows have no queries. Everything else is eager."""
        cfg, dev = self.model.cfg, self.device
        row_buckets = sorted({b for b in (1, 2, 4, 8, *range(16, max_rows + 1, 16), max_rows) if b <= max_rows})
        tok_buckets = [t for t in (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192) if t <= max_graph_tokens]
        T = max([max_rows, *tok_buckets])
        width = -(-max_model_len // self.kv.block_size)
        self.g_h = torch.zeros(T, cfg.hidden_size, dtype=self.model.dtype, device=dev)
        self.g_tok = torch.zeros(2, T, dtype=torch.int64, device=dev)  # positions, slots
        self.g_tok[1] = -1
        self.g_rows = torch.zeros(2, max_rows + 1, dtype=torch.int32, device=dev)  # cu_seqlens_q, seq_lens
        self.g_rows[1] = 1
        self.g_cu_decode = torch.arange(max_rows + 1, dtype=torch.int32, device=dev)
        self.g_tables = torch.zeros(max_rows, width, dtype=torch.int32, device=dev)
        # Compile the exit-fill kernel now, not in the middle of the first early exit (a self-copy of slot 0).
        zero = torch.zeros(1, dtype=torch.long, device=dev)
        self.model.backend.copy_kv_slots(self.kv.kv, zero, zero)
        torch.cuda.synchronize(dev)
        before = torch.cuda.memory_allocated(dev)
        pool = None
        plans = [(self.mixed_graphs, t, max_rows, t) for t in reversed(tok_buckets)]
        plans += [(self.decode_graphs, r, r, 1) for r in reversed(row_buckets)]
        for graphs, tokens, rows, max_q in plans:
            cu = self.g_cu_decode[: rows + 1] if max_q == 1 else self.g_rows[0, : rows + 1]
            meta = AttentionMetadata(cu, self.g_rows[1, :rows], self.g_tables[:rows], self.g_tok[1, :tokens],
                                     max_seqlen_q=max_q, max_seqlen_k=max_model_len)
            args = (self.g_h[:tokens], self.g_tok[0, :tokens], meta, self.kv.kv)
            for _ in range(2):  # compile and autotune outside the capture
                self.model.loop(*args)
            torch.cuda.synchronize(dev)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                out = self.model.loop(*args)
                gate = self.policy.gate_values(self.model, out)
                packed = logits = None
                if max_q == 1:
                    logits = self.model.logits(out)
                    tok = logits.argmax(-1)
                    lp = logits.gather(-1, tok[:, None])[:, 0] - torch.logsumexp(logits, -1)
                    packed = torch.stack([gate.float(), tok.float(), lp])  # ids < 2^24: exact in fp32
            pool = g.pool()
            graphs[tokens] = _Graph(g, out, gate, tokens, rows, packed, logits)
        torch.cuda.synchronize(dev)
        self.graph_memory = torch.cuda.memory_allocated(dev) - before

    def _pick_graph(self, batch: list[Sequence], tokens: int, decode_only: bool) -> Optional[_Graph]:
        """The smallest captured graph that fits the round (row bucket for decode, token bucket otherwise)."""
        graphs = self.decode_graphs if decode_only else self.mixed_graphs
        size = len(batch) if decode_only else tokens
        for key in sorted(graphs):
            if key >= size and graphs[key].rows >= len(batch):
                return graphs[key]
        return None

    def _run_graph(self, batch: list[Sequence], g: _Graph) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Replay graph g for this batch; returns (loop output, gate values, cu_seqlens_q)."""
        positions, slots, cu, lens, tables = self._metadata(batch)
        N, R = cu[-1], len(batch)
        width = max(len(t) for t in tables)
        self.g_tok[:, : g.tokens].copy_(self._to_dev(
            positions + [0] * (g.tokens - N) + slots + [-1] * (g.tokens - N), torch.int64).view(2, g.tokens))
        self.g_rows[:, : g.rows + 1].copy_(self._to_dev(
            cu + [N] * (g.rows - R) + lens + [1] * (g.rows + 1 - R), torch.int32).view(2, g.rows + 1))
        self.g_tables[:R, :width].copy_(self._to_dev_2d(tables, width, torch.int32))
        self.g_h[:N].copy_(self._gather_inputs(batch))
        g.graph.replay()
        return g.out[:N].clone(), g.gate[:N], cu

    @torch.inference_mode()
    def launch(self, batch: list[Sequence]) -> Round:
        """Advance every row of the batch one loop. Enqueues the round's GPU work and returns without
        waiting for it, except to read gate values when an exit rule needs them this round."""
        if self.staging is not None:
            self.staging.next_round()
        decode_rows = [r for r, s in enumerate(batch) if not s.item.is_prefill]
        prefill_tokens = sum(s.item.n for s in batch if s.item.is_prefill)
        graph = self._pick_graph(batch, prefill_tokens + len(decode_rows), not prefill_tokens)
        if graph is not None:
            out, gate, cu = self._run_graph(batch, graph)
            self.graph_rounds += 1
        else:
            h, positions, meta = self._prepare(batch)
            out = self.model.loop(h, positions, meta, self.kv.kv)
            cu, gate = meta.cu_seqlens_q_host, None
            self.eager_rounds += 1
        if self.overlap is not None:  # the GPU is busy with the loop
            self.overlap()
        lam_of = self._gates_needed_now(batch, decode_rows, out, cu, gate, graph)
        coda, coda_rows = self._advance(batch, out, cu, lam_of)
        self.rows_run += len(batch)
        self.tokens_run += cu[-1]
        self.last_round = dict(prefill_tokens=prefill_tokens, decode_rows=len(decode_rows), emitted=len(coda),
                               running=len(batch))
        return self._coda(coda, coda_rows, out, graph)

    @torch.inference_mode()
    def collect(self, rnd: Round) -> list[Emitted]:
        """The round's sampled tokens, once their copy to the host has landed."""
        if not rnd.emits:
            return []
        if rnd.ready is not None:
            rnd.ready.synchronize()
        tokens, logprobs = rnd.host.tolist()
        rec = rnd.logits.cpu() if rnd.logits is not None else [None] * len(rnd.emits)
        return [Emitted(s, int(t), lp, d, lg) for (s, d), t, lp, lg in zip(rnd.emits, tokens, logprobs, rec)]

    def _gates_needed_now(self, batch: list[Sequence], decode_rows: list[int], out: torch.Tensor,
                          cu: list[int], gate: Optional[torch.Tensor], graph: Optional[_Graph]) -> dict[int, float]:
        """Gate values of the decode rows whose exit rule reads them after this loop (a read-back, so the
        round is synchronous); {} when every exit is decided on the host."""
        need = [r for r in decode_rows if not self.policy.decides_on_host(batch[r].item.bounds)]
        if not need:
            return {}
        if graph is not None and graph.packed is not None:  # decode graph: row r is token r
            lams = graph.packed[0, : len(batch)].tolist()
            return {r: lams[r] for r in need}
        idx = self._to_dev([cu[r] for r in need], torch.long)
        lams = (gate.index_select(0, idx) if gate is not None
                else self.policy.gate_values(self.model, out.index_select(0, idx))).tolist()
        return dict(zip(need, lams))

    def _advance(self, batch: list[Sequence], out: torch.Tensor, cu: list[int], lam_of: dict[int, float]):
        """Move every item one loop on; returns the (sequence, depth) pairs that need a token, with their rows."""
        coda, coda_rows, fill = [], [], []
        for r, seq in enumerate(batch):
            item = seq.item
            done_loop = item.loop
            item.src, item.src_row = out, cu[r]
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
            self.model.backend.copy_kv_slots(self.kv.kv, self._to_dev(list(src), torch.long),
                                             self._to_dev(list(dst), torch.long))
        return coda, coda_rows

    def _coda(self, coda, coda_rows: list[int], out: torch.Tensor, graph: Optional[_Graph]) -> Round:
        """LM head + sampling for the rows that finished their loops, left on the device; the copy back
        to the host is started here and awaited by `collect`."""
        if not coda:
            return Round([])
        seqs = [s for s, _ in coda]
        rows = self._to_dev(coda_rows, torch.long)
        in_graph = graph is not None and graph.packed is not None
        logits = None
        if in_graph and not self.record_logits and all(s.params.temperature == 0 for s in seqs):
            # Greedy rows of a decode graph: the graph already computed token and logprob.
            result = graph.packed[1:].index_select(1, rows)
        else:
            logits = graph.logits.index_select(0, rows) if in_graph else self.model.logits(out.index_select(0, rows))
            tokens, logprobs = sample(logits, [s.params for s in seqs], [s.generator for s in seqs])
            result = torch.stack([tokens.float(), logprobs.float()])  # ids < 2^24: exact in fp32
        for i, seq in enumerate(seqs):
            seq.num_pending += 1
            seq.token_src = (result, i)
        rnd = Round(coda, logits=logits if self.record_logits else None)
        if self.staging is not None:
            rnd.host, rnd.ready = self.staging.readback(result)
        else:
            rnd.host = result
        return rnd
