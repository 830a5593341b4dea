"""Turns a `SchedulerOutput` into device work and reads back what it produced.

A launch runs one round with prompt chunks, or one or more decode-only rounds. A round is: prelude
(embed rows entering loop 1) -> one loop over all rows -> for decode rows, the exit decision on the
device, the LAST_EXITED fill and the coda (LM head + sampling) -> each decode row's next step written
back into the decode state (`decode_state.py`). Rows whose prompt finishes this round sample their first
token and become decode rows. Nothing in a round needs the host: each one leaves a record (which slots
emitted a token, the token, its depth and logprob) that is copied to pinned host memory and read by
`collect` a launch later (docs/engine.md).

CUDA graphs: decode-only launches are captured per (row bucket, rounds per launch, sampler mode), state
update and coda included; rounds with prompt chunks capture the loop per token bucket and run the rest
eagerly. The runner owns its device state; the scheduler's `Sequence`s carry none.
"""
from __future__ import annotations

import gc
import logging
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch

from ..config import KVLayout
from ..model.attention import AttentionMetadata
from ..model.ouro import OuroModel
from ..model.sampler import SamplerMode, sample, vocab_hashes
from . import decode_state as ds, decode_step
from .decode_state import DecodeState, NewRow
from .decode_step import DecodeInputs
from .exit_policy import ExitPolicy
from .kv_cache import KVCache
from .scheduler import PrefillChunk, SchedulerOutput
from .sequence import Sequence
from .speculation import REC_ACCEPTED, REC_DRAFTED, spec_record, spec_step
from .swap import SwapStore

log = logging.getLogger(__name__)


@dataclass
class Launch:
    """A launched plan: whom its slots belonged to and where its records land."""
    owners: list[Optional[Sequence]]
    host: Optional[torch.Tensor] = None  # fp32 [rounds, 4, slots], filled once `ready` fires
    speculative: bool = False  # the record's last round holds acceptance counts (speculation.py)
    ready: Optional[torch.cuda.Event] = None
    # record_logits only: per round, (slots, fp32 logits [len(slots), V]) of the rows that could emit
    logits: list[list[tuple[list[int], torch.Tensor]]] = field(default_factory=list)
    # Requests whose own staging raised (`ModelRunner._apply_rows`), with what they raised: they took no part
    # in the launch's rounds and their rows are off; the engine ends them.
    failed: list[tuple[Sequence, Exception]] = field(default_factory=list)


@dataclass
class Emitted:
    seq: Sequence
    token: int
    logprob: float
    depth: int
    logits: Optional[torch.Tensor] = None  # only when the runner records logits (tests, debugging)
    # On the first token a speculative step emitted for a request: the drafts it accepted in that step.
    spec_accepted: Optional[int] = None


@dataclass
class RunnerStats:
    launches: int = 0
    rounds: int = 0
    graph_launches: int = 0
    eager_launches: int = 0
    host_syncs: int = 0  # reads that waited for the device with no later launch queued (the GPU drained)
    spec_steps: int = 0  # speculative steps launched
    spec_drafted: int = 0  # draft tokens proposed (spec_tokens per running row and step), counted when read
    spec_accepted: int = 0  # of those, verified and emitted (or cut by a stop on the device)


class HostStaging:
    """Persistent pinned buffers for a launch's small host<->device transfers.

    Pinning fresh tensors every round is slow (page-locked allocations); instead each launch bump-allocates
    from one of two pinned halves, and an event guards a half until the copies that use it have run. A
    half also holds the launch's read-back, which the engine collects before the half comes round again.
    """

    def __init__(self, device: torch.device, size: int = 1 << 20):
        self.device = device
        self.halves = [torch.empty(size, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        self.views = [h.numpy() for h in self.halves]
        self.back = [torch.empty(size // 8, dtype=torch.float32, pin_memory=True) for _ in range(2)]
        self.events: list[Optional[torch.cuda.Event]] = [None, None]
        self.cur, self.off, self.back_off = 0, 0, 0

    def next_round(self) -> None:
        ev = torch.cuda.Event()
        ev.record()
        self.events[self.cur] = ev
        self.cur ^= 1
        self.off = self.back_off = 0
        prev = self.events[self.cur]
        if prev is not None:
            prev.synchronize()

    def put(self, data: list | np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        n = len(data)
        if self.off + n > self.views[self.cur].shape[0]:
            return torch.tensor(data, dtype=dtype).to(self.device)  # oversized: plain (synchronous) copy
        if dtype == torch.float64:  # staged as its bit pattern
            data = np.asarray(data, dtype=np.float64).view(np.int64)
        self.views[self.cur][self.off: self.off + n] = data
        host = self.halves[self.cur][self.off: self.off + n]
        self.off += n
        dev = host.to(self.device, non_blocking=True)
        if dtype == torch.float64:
            return dev.view(torch.float64)
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
class _PrefillInputs:
    """A round's prompt tokens (after the decode rows): inputs, metadata, and cu_seqlens of all rows."""
    h: torch.Tensor
    pos: torch.Tensor
    slot: torch.Tensor
    cu: torch.Tensor  # int32 [decode rows + prompt rows + 1]
    lens: torch.Tensor  # int32 [prompt rows]
    tables: torch.Tensor  # int32 [prompt rows, max_blocks]
    max_q: int
    cu_host: Optional[list[int]] = None
    lens_host: Optional[list[int]] = None


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    tokens: int  # prompt tokens (mixed graphs)
    rows: int  # decode rows
    rec: torch.Tensor  # [rounds, 4, slots] records
    logits: Optional[torch.Tensor]  # the last round's decode-row logits [rows, V] (None: speculative graphs)
    out: Optional[torch.Tensor] = None  # mixed graphs: [tokens, H] loop output of the prompt tokens
    prefill_rows: int = 0  # mixed graphs: prompt chunks it can take


class ModelRunner:
    def __init__(self, model: OuroModel, kv: KVCache, policy: ExitPolicy, num_slots: int, max_model_len: int,
                 eos_ids: list[int], exit_threshold: float, spec_tokens: int = 0, spec_draft_loops: int = 1):
        self.model = model
        self.exit_threshold = exit_threshold  # for requests that set none
        self.kv = kv
        self.policy = policy
        self.num_loops = T = model.cfg.total_ut_steps
        self.device = dev = model.device
        self.max_model_len = max_model_len
        self.spec_tokens, self.spec_draft_loops = spec_tokens, spec_draft_loops
        self.max_blocks = -(-(max_model_len + spec_tokens) // kv.block_size)  # drafts run past the last token
        self.state = DecodeState(num_slots, T, self.max_blocks, model.cfg.hidden_size, model.dtype, dev)
        self.vocab_hash = vocab_hashes(model.cfg.vocab_size, dev)
        self.eos = torch.tensor(sorted(eos_ids) or [-1], dtype=torch.int64, device=dev)  # -1: no EOS
        self._last_exited = kv.layout is KVLayout.LAST_EXITED
        # The state machine around the loop: fused Triton kernels with the graph-safe GPU backends, else
        # their torch twins.
        self.fused = dev.type == "cuda" and getattr(model.backend, "graph_safe", False)
        self.carry: dict[int, tuple[torch.Tensor, int]] = {}  # slot -> (loop output, first row) of a prompt chunk
        self.stats = RunnerStats()
        self.record_logits = False
        self.track_gpu_time = False
        # (start, end, prompt tokens, decode rows, rounds) of each launch while track_gpu_time is set
        self._gpu_windows: list[tuple[torch.cuda.Event, torch.cuda.Event, int, int, int]] = []
        self.decode_graphs: dict[tuple[int, int, SamplerMode], _Graph] = {}
        self.mixed_graphs: dict[tuple[int, SamplerMode], _Graph] = {}  # rounds with prompt chunks, per token bucket
        self.spec_graphs: dict[tuple[int, SamplerMode], _Graph] = {}  # speculative steps, per row bucket
        self.row_buckets: list[int] = []  # the decode and speculative graphs' row counts (none: no graphs)
        self.graph_memory = 0
        self.last_round: dict[str, int] = {}
        self._newest: Optional[Launch] = None
        # Host work to do while the GPU runs a launch (the engine process sends the previous step's outputs
        # here). It must not call into the engine.
        self.overlap: Optional[Callable[[], None]] = None
        self.staging = HostStaging(dev) if dev.type == "cuda" else None
        self.arange = torch.arange(max(num_slots, T) + 1, dtype=torch.int64, device=dev)  # static: graphs index it
        self.swap = SwapStore(kv, self.state, self._to_dev)

    def _to_dev(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        """A flat host list on the device without a device sync (pinned staging on CUDA)."""
        if self.staging is None:
            return torch.tensor(data, dtype=dtype)
        return self.staging.put(data, dtype)

    # ---- the decode state machine (runs eagerly or inside a graph) ----
    def _decode_inputs(self, idx: torch.Tensor) -> DecodeInputs:
        """The loop's inputs for decode rows `idx` (slots), read from the decode state."""
        return decode_step.prepare(self.state, idx, self.model.embed_tokens, self.kv.block_size, self._last_exited,
                                   self.fused)

    def _advance_decode(self, idx: torch.Tensor, rows: DecodeInputs, out: torch.Tensor, rec: torch.Tensor,
                        mode: SamplerMode) -> torch.Tensor:
        """After the loop: gate, coda, then exits, next steps and the LAST_EXITED fill; returns the logits."""
        st = self.state
        lam = self.policy.gate_values(self.model, out) if self.policy.needs_gate else None
        logits = self.model.logits(out)
        tok, lp = self._sample(idx, logits, mode)
        src, dst = decode_step.advance(st, idx, lam, tok, lp, rows.slots_all, self.eos, rec, self.policy.mode,
                                       self._last_exited, self.fused)
        if self._last_exited and self.num_loops > 1:
            self.model.backend.copy_kv_slots(self.kv.kv, src.flatten(), dst.flatten())
        st.hidden.index_copy_(0, idx, out)
        return logits

    def sampling_rows(self, idx: torch.Tensor, mode: SamplerMode, offset: torch.Tensor | int = 0) -> tuple:
        """The per-row sampler arguments of slots `idx` (none for GREEDY): temperature, top-k, top-p, seed,
        and the noise counter = tokens the request generated so far + `offset`."""
        if mode is SamplerMode.GREEDY:
            return ()
        ints, floats = self.state.ints.index_select(0, idx), self.state.floats.index_select(0, idx)
        return (floats[:, ds.TEMPERATURE], ints[:, ds.TOP_K], floats[:, ds.TOP_P], ints[:, ds.SEED],
                ints[:, ds.NGEN] + offset, self.vocab_hash)

    def _sample(self, idx: torch.Tensor, logits: torch.Tensor, mode: SamplerMode) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' next tokens and their logprobs."""
        return sample(logits, mode, *self.sampling_rows(idx, mode))

    def _complete_prompts(self, chunks: list[PrefillChunk], out: torch.Tensor, first_row: list[int],
                          rec: torch.Tensor, mode: SamplerMode) -> Optional[torch.Tensor]:
        """Rows whose prompt finishes this round: the first token, and the request becomes a decode row."""
        if not chunks:
            return None
        idx = self._to_dev([c.slot for c in chunks], torch.long)
        last = self._to_dev([first_row[i] + c.n - 1 for i, c in enumerate(chunks)], torch.long)
        logits = self.model.logits(out.index_select(0, last))
        tok, lp = self._sample(idx, logits, mode)
        yes = torch.ones(len(chunks), dtype=torch.bool, device=self.device)
        depth = torch.full((len(chunks),), self.num_loops, dtype=torch.long, device=self.device)
        decode_step.emit(self.state, idx, self.state.ints.index_select(0, idx), yes, yes, tok, lp, depth,
                         torch.ones(len(chunks), device=self.device), ~yes, self.eos, rec)
        return logits

    # ---- launches ----
    @torch.inference_mode()
    def launch(self, plan: SchedulerOutput) -> Launch:
        """Enqueue the plan's device work and return without waiting for it."""
        if self.staging is not None:
            self.staging.next_round()
        start = self._window_start()
        failed = self._apply_rows(plan)
        if plan.speculate:  # loops over all rows: K + 1 drafts of d loops, then the verify pass's T - d
            rounds = (self.spec_tokens + 1) * self.spec_draft_loops + self.num_loops - self.spec_draft_loops
        elif not (plan.prefill or plan.decode_slots):
            rounds = 0  # only rows to switch off: no round runs
        elif plan.prefill or self.record_logits:
            rounds = 1
        else:
            rounds = plan.num_rounds
        launch = Launch(list(plan.owners), speculative=plan.speculate, failed=failed)
        if plan.speculate:
            rec = self._spec_launch(plan)
        elif plan.prefill:
            rec = self._mixed_round(plan, launch)
        elif plan.decode_slots:
            rec = self._decode_launch(plan, launch, rounds)
        else:  # only rows released: nothing to run
            rec = self.state.new_record(rounds)
        if self.overlap is not None:  # the GPU is busy with the launch
            self.overlap()
        self._window_end(start, plan, rounds)
        if self.staging is not None:
            launch.host, launch.ready = self.staging.readback(rec)
        else:
            launch.host = rec
        self.stats.launches += 1
        self.stats.rounds += rounds
        self.last_round = dict(prefill_tokens=sum(c.n for c in plan.prefill), decode_rows=len(plan.decode_slots),
                               rounds=rounds, running=sum(s is not None for s in plan.owners))
        self._newest = launch
        return launch

    def _apply_rows(self, plan: SchedulerOutput) -> list[tuple[Sequence, Exception]]:
        """Save the rows of preempted requests, switch off the rows of requests the host ended or preempted,
        bring resumed rows back, write the rows of admitted ones and extend the block tables that grew.

        Each request's own part (its swap copy, its restored row, its new row's host values) runs on its own:
        one that raises is returned with its exception, its row is switched off and its work is taken out of
        the plan, so the rounds run without it. The batched writes take only rows that staged."""
        failed: list[tuple[Sequence, Exception]] = []

        def own(seq: Sequence, fn, *args):
            try:
                return fn(*args)
            except Exception as e:
                log.exception("request %s: staging its row failed", seq.request_id)
                failed.append((seq, e))
                return None

        for s in plan.swap_out:
            own(s.seq, self.swap.save, s.key, s.slot, s.blocks, s.counts)
        for key in plan.swap_dropped:
            self.swap.drop(key)
        for slot in plan.released:
            self.carry.pop(slot, None)
        if plan.released:
            self.state.release(self._to_dev(plan.released, torch.long))
        for si in plan.swap_in:
            own(si.seq, self.swap.restore, si.key, si.slot, si.tables)
        if plan.table_growth:
            slots, planes, index, blocks = zip(*plan.table_growth)
            self.state.tables.index_put_((self._to_dev(list(slots), torch.long), self._to_dev(list(planes), torch.long),
                                          self._to_dev(list(index), torch.long)),
                                         self._to_dev(list(blocks), torch.int32))
        staged = [(s.slot, row) for s in plan.admitted if (row := own(s, self._admission_row, s)) is not None]
        if staged:
            ints, floats, traces, tables = [], [], [], []
            for _, (i, f, tr, tb) in staged:
                ints += i
                floats += f
                traces += tr
                tables += tb
            self.state.admit(self._to_dev([slot for slot, _ in staged], torch.long), self._to_dev(ints, torch.long),
                             self._to_dev(floats, torch.float64),
                             self._to_dev(traces, torch.long), self._to_dev(tables, torch.int32))
        if failed:
            self._take_out(plan, [seq for seq, _ in failed])
        return failed

    def _admission_row(self, seq: Sequence) -> tuple[list, list, list, list]:
        """An admitted request's host values for `DecodeState.admit` (raises for a value its row cannot hold)."""
        p = seq.params
        assert seq.slot is not None  # admitted: it holds a slot
        row = NewRow(seq.slot, len(seq.prompt_ids), p, p.max_loops or self.num_loops,
                     self.exit_threshold if p.exit_threshold is None else p.exit_threshold, seq.seed,
                     seq.block_tables, (seq.output_ids[-1], len(seq.output_ids)) if seq.resuming else None)
        return DecodeState.host_row(row, self.num_loops, self.max_blocks)

    def _take_out(self, plan: SchedulerOutput, gone: list[Sequence]) -> None:
        """Switch the rows of `gone` off and drop their prompt chunks and decode rows from the plan."""
        slots = [seq.slot for seq in gone if seq.slot is not None]  # a request swapped out has none
        if slots:
            self.state.release(self._to_dev(slots, torch.long))
        ids = {id(seq) for seq in gone}
        plan.prefill = [c for c in plan.prefill if id(c.seq) not in ids]
        plan.decode_slots = [s for s in plan.decode_slots if id(plan.owners[s]) not in ids]
        plan.speculate = plan.speculate and bool(plan.decode_slots)

    def _spec_launch(self, plan: SchedulerOutput) -> torch.Tensor:
        self.stats.spec_steps += 1
        rows = self._bind_rows(plan, self.row_buckets)
        graph = self.spec_graphs.get((len(rows), plan.sampler)) if rows else None
        if graph is not None:
            graph.graph.replay()
            self.stats.graph_launches += 1
            return graph.rec
        rec = spec_record(self.state, self.spec_tokens)
        spec_step(self, self._to_dev(plan.decode_slots, torch.long), self.spec_tokens, self.spec_draft_loops, rec,
                  plan.sampler)
        self.stats.eager_launches += 1
        return rec

    def _decode_launch(self, plan: SchedulerOutput, launch: Launch, rounds: int) -> torch.Tensor:
        rows = self._bind_rows(plan, self.row_buckets)
        graph = self.decode_graphs.get((len(rows), rounds, plan.sampler)) if rows else None
        if graph is not None:
            graph.graph.replay()
            self.stats.graph_launches += 1
            if self.record_logits:  # one round a launch then: the graph keeps the last round's logits
                assert rows is not None and graph.logits is not None  # a decode graph was picked for these rows
                launch.logits.append([(rows, graph.logits.float().clone())])
            return graph.rec
        rec = self.state.new_record(rounds)
        logits = self._decode_steps(self._to_dev(plan.decode_slots, torch.long), rec, plan.sampler)
        if self.record_logits:  # one round a launch then
            assert logits is not None  # rounds >= 1
            launch.logits.append([(plan.decode_slots, logits.float())])
        self.stats.eager_launches += 1
        return rec

    def _decode_meta(self, rows: DecodeInputs) -> AttentionMetadata:
        S = rows.pos.shape[0]
        return AttentionMetadata(self.arange[: S + 1].int(), rows.seq_lens, rows.tables, rows.slot,
                                 max_seqlen_q=1, max_seqlen_k=self.max_model_len,
                                 cu_seqlens_q_host=list(range(S + 1)))

    def _mixed_round(self, plan: SchedulerOutput, launch: Launch) -> torch.Tensor:
        """A round with prompt chunks (and the decode rows, if any): one loop over all their tokens. With
        graphs, the decode rows are every slot (idle ones masked) and the prompt tokens a token bucket."""
        bs, T = self.kv.block_size, self.num_loops
        N = sum(c.n for c in plan.prefill)
        graph = self._pick_mixed_graph(N, len(plan.prefill), plan.sampler)
        D = graph.rows if graph is not None else len(plan.decode_slots)
        positions: list[int]
        slots: list[int]
        positions, slots, cu, lens, tables, ids, first_row = [], [], list(range(D + 1)), [], [], [], []
        fill_src, fill_dst = [], []  # recomputed positions whose recorded depth is this loop: exit fill
        for c in plan.prefill:
            table = c.seq.block_tables[c.loop - 1]
            end = c.start + c.n
            first_row.append(cu[-1] - D)
            positions.extend(range(c.start, end))
            if end <= len(c.seq.prompt_ids):
                slots.extend(table[p // bs] * bs + p % bs for p in range(c.start, end))
            else:  # a recompute: past its recorded depth a position writes nothing; at it, it fills deeper planes
                for p in range(c.start, end):
                    d = c.seq.position_depth(p, T)
                    slots.append(self.kv.slot(table, p) if d >= c.loop else -1)
                    if d == c.loop:
                        fill_src += [slots[-1]] * (T - d)
                        fill_dst += [self.kv.slot(c.seq.block_tables[q], p) for q in range(d, T)]
            cu.append(cu[-1] + c.n)
            lens.append(end)
            t = table[: -(-end // bs)]
            tables.extend(t + [0] * (self.max_blocks - len(t)))
            if c.loop == 1:
                ids.extend(c.seq.token_ids(c.start, end))
        embedded = self.model.embed(self._to_dev(ids, torch.long)) if ids else None
        parts, used = [], 0
        for c in plan.prefill:
            if c.loop == 1:
                assert embedded is not None  # loop-1 chunks put their tokens in `ids`
                parts.append(embedded[used: used + c.n])
                used += c.n
            else:
                src, row = self.carry.pop(c.slot)
                parts.append(src[row: row + c.n])
        h = torch.cat(parts) if len(parts) > 1 else parts[0]
        P = len(plan.prefill)
        if graph is not None:
            pad_rows = graph.prefill_rows - P
            pre = self._prefill_inputs(graph.tokens, graph.prefill_rows)
            pre.h[:N].copy_(h)
            pre.pos.copy_(self._to_dev(positions + [0] * (graph.tokens - N), torch.long))
            pre.slot.copy_(self._to_dev(slots + [-1] * (graph.tokens - N), torch.long))
            pre.cu.copy_(self._to_dev(cu + [cu[-1]] * pad_rows, torch.int32))
            pre.lens.copy_(self._to_dev(lens + [1] * pad_rows, torch.int32))
            pre.tables[:P].copy_(self._to_dev(tables, torch.int32).view(P, self.max_blocks))
            graph.graph.replay()
            assert graph.out is not None  # mixed graphs have it
            out, rec = graph.out[:N].clone(), graph.rec
            self.stats.graph_launches += 1
            logits = graph.logits
            dec_slots = list(range(D))
        else:
            pre = _PrefillInputs(h, self._to_dev(positions, torch.long), self._to_dev(slots, torch.long),
                                 self._to_dev(cu, torch.int32), self._to_dev(lens, torch.int32),
                                 self._to_dev(tables, torch.int32).view(P, self.max_blocks), max(c.n for c in plan.prefill),
                                 cu_host=cu, lens_host=lens)
            rec = self.state.new_record(1)
            idx = self._to_dev(plan.decode_slots, torch.long) if D else None
            out, logits = self._mixed_step(idx, pre, rec[0], plan.sampler)
            self.stats.eager_launches += 1
            dec_slots = plan.decode_slots
        if fill_src:
            self.model.backend.copy_kv_slots(self.kv.kv, self._to_dev(fill_src, torch.long),
                                             self._to_dev(fill_dst, torch.long))
        round_logits: list[tuple[list[int], torch.Tensor]] = []
        if D:
            assert logits is not None  # the round had decode rows
            round_logits.append((dec_slots, logits))
        done = [i for i, c in enumerate(plan.prefill) if c.loop == T and c.start + c.n == c.seq.prefill_target]
        resumed = [plan.prefill[i].slot for i in done if plan.prefill[i].seq.resuming]
        if resumed:  # the row already holds its next token: it only starts decoding
            self.state.ints[:, ds.ACTIVE].index_fill_(0, self._to_dev(resumed, torch.long), 1)
        completing = [i for i in done if not plan.prefill[i].seq.resuming]
        logits = self._complete_prompts([plan.prefill[i] for i in completing], out,
                                        [first_row[i] for i in completing], rec[0], plan.sampler)
        if logits is not None:
            round_logits.append(([plan.prefill[i].slot for i in completing], logits))
        for i, c in enumerate(plan.prefill):
            if c.loop < T:
                self.carry[c.slot] = (out, first_row[i])
        if self.record_logits:
            launch.logits.append([(s, lg.float().clone()) for s, lg in round_logits])
        return rec

    def _mixed_step(self, idx: Optional[torch.Tensor], pre: "_PrefillInputs", rec: torch.Tensor,
                    mode: SamplerMode) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """One loop over decode rows `idx` (from the state; None: none) followed by prompt tokens `pre`;
        advances the decode rows and returns the prompt tokens' loop output and the decode rows' logits."""
        D = 0 if idx is None else idx.shape[0]
        dec = self._decode_inputs(idx) if idx is not None and D else None  # (D > 0: idx is not None)
        cat = (lambda a, b: torch.cat([a, b])) if D else (lambda a, b: b)  # noqa: E731
        # Below, `dec is not None` is D > 0.
        meta = AttentionMetadata(pre.cu, cat(dec.seq_lens if dec is not None else None, pre.lens),
                                 cat(dec.tables if dec is not None else None, pre.tables),
                                 cat(dec.slot if dec is not None else None, pre.slot),
                                 max_seqlen_q=pre.max_q, max_seqlen_k=self.max_model_len,
                                 cu_seqlens_q_host=pre.cu_host,
                                 seq_lens_host=pre.lens_host if not D else None,
                                 decode_rows=D, cu_prefill=pre.cu[D:] - D if D else None)
        out = self.model.loop(cat(dec.h if dec is not None else None, pre.h),
                              cat(dec.pos if dec is not None else None, pre.pos), meta, self.kv.kv)
        logits = self._advance_decode(idx, dec, out[:D], rec, mode) if idx is not None and dec is not None else None
        return out[D:], logits

    @torch.inference_mode()
    def collect(self, launch: Launch) -> list[Emitted]:
        """The launch's tokens, once its records have landed on the host (in round and slot order)."""
        if launch.ready is not None:
            if not launch.ready.query():
                if launch is self._newest:
                    self.stats.host_syncs += 1
                launch.ready.synchronize()
        elif launch is self._newest and self.device.type == "cuda":
            self.stats.host_syncs += 1
        assert launch.host is not None  # set by launch()
        rec = launch.host.numpy()  # pinned host memory (CUDA) or the CPU record itself
        rounds, slots = np.nonzero(rec[:, ds.REC_EMITTED])
        if launch.speculative:
            self.stats.spec_drafted += self.spec_tokens * int(rec[-1, REC_DRAFTED].sum())
            self.stats.spec_accepted += int(rec[-1, REC_ACCEPTED].sum())
        out = []
        for r, s in zip(rounds.tolist(), slots.tolist()):
            seq = launch.owners[s]
            logits = None
            if launch.logits:
                for owned, lg in launch.logits[r]:
                    if s in owned:
                        logits = lg[owned.index(s)].cpu()
            out.append(Emitted(seq, int(rec[r, ds.REC_TOKEN, s]), float(rec[r, ds.REC_LOGPROB, s]),
                               int(rec[r, ds.REC_DEPTH, s]), logits))
            if launch.speculative and r == 0:  # every row a step drafted for emits its token 0
                out[-1].spec_accepted = int(rec[-1, REC_ACCEPTED, s])
        return out

    # ---- GPU time (ouro-bench) ----
    def _window_start(self) -> Optional[torch.cuda.Event]:
        if not (self.track_gpu_time and self.device.type == "cuda"):
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def _window_end(self, start: Optional[torch.cuda.Event], plan: SchedulerOutput, rounds: int) -> None:
        if start is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._gpu_windows.append((start, end, sum(c.n for c in plan.prefill), len(plan.decode_slots), rounds))

    def gpu_time(self) -> tuple[float, float, list[tuple[float, int, int, int]]]:
        """(span, busy, launches) of the launches recorded since the last call: busy is the sum of each
        launch's device seconds, span runs from the first start to the last end, and `launches` lists each
        one's (device seconds, prompt tokens, decode rows, rounds). Waits for them."""
        wins, self._gpu_windows = self._gpu_windows, []
        if not wins:
            return 0.0, 0.0, []
        wins[-1][1].synchronize()
        launches = [(a.elapsed_time(b) / 1e3, *shape) for a, b, *shape in wins]
        return wins[0][0].elapsed_time(wins[-1][1]) / 1e3, sum(x[0] for x in launches), launches

    # ---- CUDA graphs ----
    @torch.inference_mode()
    def capture_graphs(self, max_rows: int, max_graph_tokens: int, rounds_per_launch: int) -> None:
        """Capture decode-only launches per row bucket x {1, rounds_per_launch} rounds x sampler mode, and
        rounds with prompt chunks per prompt-token bucket x sampler mode, whose decode rows are all
        `max_rows` slots. Pad tokens get slot -1 (no KV write); rows of idle slots are masked by the state."""
        cfg, dev = self.model.cfg, self.device
        row_buckets = sorted({b for b in (1, 2, 4, 8, *range(16, max_rows + 1, 16), max_rows) if b <= max_rows})
        self.row_buckets = row_buckets
        # Prompt tokens are padded to the next bucket: steps of a quarter of each power of two above 256.
        tok_buckets = sorted({t for p in range(4, 14) for t in ((1 << p),) + tuple((1 << p) + q * (1 << p) // 4
                              for q in range(1, 4) if p >= 8) if t <= max_graph_tokens})
        Tk = max(tok_buckets, default=0)
        self.g_h = torch.zeros(Tk, cfg.hidden_size, dtype=self.model.dtype, device=dev)
        self.g_pos = torch.zeros(Tk, dtype=torch.int64, device=dev)
        self.g_slot = torch.full((Tk,), -1, dtype=torch.int64, device=dev)
        self.g_cu = torch.cat([torch.arange(max_rows + 1), torch.full((max_rows,), max_rows)]).int().to(dev)
        self.g_lens = torch.ones(max_rows, dtype=torch.int32, device=dev)
        self.g_tables = torch.zeros(max_rows, self.max_blocks, dtype=torch.int32, device=dev)
        # The slots that decode and speculative graphs run (see _bind_rows); _bound mirrors it on the host.
        self.g_rows = torch.arange(max_rows, dtype=torch.int64, device=dev)
        self._bound = list(range(max_rows))
        # Every graph's outputs go to these shared buffers (see _shared_outputs).
        self.g_logits = torch.empty(max_rows, self.model.lm_head.shape[0], dtype=torch.float32, device=dev)
        self.g_out = torch.empty(Tk, cfg.hidden_size, dtype=self.model.dtype, device=dev)
        # Compile the exit-fill kernel now, not in the middle of the first early exit (a self-copy of slot 0).
        zero = torch.zeros(1, dtype=torch.long, device=dev)
        self.model.backend.copy_kv_slots(self.kv.kv, zero, zero)
        torch.cuda.synchronize(dev)
        # Reserved, not allocated: what a graph uses inside itself is free to the allocator after its
        # capture yet stays in the graphs' pool for its replays.
        before = torch.cuda.memory_reserved(dev)
        self._pool: Optional[torch.cuda._POOL_HANDLE] = None  # the graphs' memory pool, from the first capture
        # A collection during a capture would run Python finalizers (and their CUDA frees) mid-capture and
        # costs seconds over hundreds of captures: collect once, then pause the collector until done.
        gc.collect()
        gc.disable()
        try:
            self._capture_all(max_rows, row_buckets, tok_buckets, rounds_per_launch)
        finally:
            gc.enable()
        torch.cuda.synchronize(dev)
        self.graph_memory = torch.cuda.memory_reserved(dev) - before

    def _capture_all(self, max_rows: int, row_buckets: list[int], tok_buckets: list[int],
                     rounds_per_launch: int) -> None:
        idx = self.arange[:max_rows]
        for mode in SamplerMode:
            for t in reversed(tok_buckets):
                pre = self._prefill_inputs(t, max_rows)
                rec, (out, logits) = self._capture(
                    lambda rec: self._shared_outputs(*self._mixed_step(idx, pre, rec[0], mode)), 1)
                self.mixed_graphs[(t, mode)] = _Graph(self._last_graph, t, max_rows, rec, logits, out, max_rows)
            for rounds in sorted({1, rounds_per_launch}, reverse=True):
                for b in reversed(row_buckets):
                    rec, (_, logits) = self._capture(
                        lambda rec: self._shared_outputs(None, self._decode_steps(self.g_rows[:b], rec, mode)), rounds)
                    self.decode_graphs[(b, rounds, mode)] = _Graph(self._last_graph, 0, b, rec, logits)
        if self.spec_tokens:  # speculative steps: idle rows of a bucket are masked by the state, as above
            K, d = self.spec_tokens, self.spec_draft_loops
            for mode in SamplerMode:
                for b in reversed(row_buckets):
                    rec, _ = self._capture(lambda rec: spec_step(self, self.g_rows[:b], K, d, rec, mode), K + 2)
                    self.spec_graphs[(b, mode)] = _Graph(self._last_graph, 0, b, rec, None)

    def _shared_outputs(self, out: Optional[torch.Tensor], logits: Optional[torch.Tensor]) -> tuple:
        """Inside a capture: copy the graph's outputs (prompt tokens' loop output, decode rows' logits) into
        buffers that all graphs share, so that its own, in the graphs' memory pool, are free when the
        capture ends and later graphs reuse that memory. A launch reads its graph's outputs before the next
        launch replays another (docs/engine.md, "Measurements behind the design": graph memory)."""
        if out is not None:
            out = self.g_out[: out.shape[0]].copy_(out)
        if logits is not None:
            logits = self.g_logits[: logits.shape[0]].copy_(logits)
        return out, logits

    def _capture(self, fn: Callable[[torch.Tensor], object], rounds: int):
        """Warm fn up (compile and autotune outside the capture; with idle rows nothing in the state
        changes), then capture it into `self._last_graph`; returns (its record, what fn returned)."""
        for _ in range(2):
            fn(self.state.new_record(rounds))
        torch.cuda.synchronize(self.device)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self._pool):
            rec = self.state.new_record(rounds)
            result = fn(rec)
        self._pool = g.pool()
        self._last_graph = g
        return rec, result

    def _prefill_inputs(self, tokens: int, rows: int) -> _PrefillInputs:
        """The graphs' static prompt-token inputs (after the graphs' decode rows, one per slot)."""
        D = self.g_tables.shape[0]
        return _PrefillInputs(self.g_h[:tokens], self.g_pos[:tokens], self.g_slot[:tokens], self.g_cu[: D + rows + 1],
                              self.g_lens[:rows], self.g_tables[:rows], tokens)

    def _decode_steps(self, idx: torch.Tensor, rec: torch.Tensor, mode: SamplerMode) -> Optional[torch.Tensor]:
        logits = None
        for r in range(rec.shape[0]):
            rows = self._decode_inputs(idx)
            out = self.model.loop(rows.h, rows.pos, self._decode_meta(rows), self.kv.kv)
            logits = self._advance_decode(idx, rows, out, rec[r], mode)
        return logits

    def _bind_rows(self, plan: SchedulerOutput, sizes: list[int]) -> Optional[list[int]]:
        """Point the row graphs at the plan's decode rows: the smallest captured size b that holds them,
        with `g_rows[:b]` = the decode slots, then free slots as padding (idle on the device, so masked).
        Returns those b slots, or None when no size holds the rows (the launch then runs eagerly).
        Indexing rows, not a slot range, matters as a closed run drains: its last few requests keep
        whatever slots they had, and a range up to the highest would pay for every slot below it."""
        n = len(plan.decode_slots)
        fits = [b for b in sizes if b >= n]
        if not fits:
            return None
        b: Optional[int]
        b = min(fits)
        rows = list(plan.decode_slots)
        if b > n:  # decode slots have owners, so the free slots are the others
            rows += [s for s, owner in enumerate(plan.owners) if owner is None][: b - n]
        if len(rows) < b:  # not enough free slots to pad with: a slot range that covers every row
            span = max(plan.decode_slots) + 1
            b = min((x for x in sizes if x >= span), default=None)
            if b is None:
                return None
            rows = list(range(b))
        if rows != self._bound[:b]:
            self.g_rows[:b].copy_(self._to_dev(rows, torch.long))
            self._bound[:b] = rows
        return rows

    def _pick_mixed_graph(self, tokens: int, chunks: int, mode: SamplerMode) -> Optional[_Graph]:
        best = None
        for (t, m), g in self.mixed_graphs.items():
            if m is mode and t >= tokens and g.prefill_rows >= chunks and (best is None or t < best.tokens):
                best = g
        return best
