"""Turns a `SchedulerOutput` into device work and reads back what it produced.

A launch runs one round with prompt chunks, or one or more decode-only rounds, or one speculative step
(`speculation.py`). A round is: prelude (embed rows entering loop 1) -> one loop over all rows -> for
decode rows, the exit decision on the device, the LAST_EXITED fill and the coda (LM head + sampling) ->
each decode row's next step written back into the decode state (`decode_state.py`). Rows whose prompt
finishes this round sample their first token and become decode rows. Nothing in a round needs the host:
each one leaves a record (which slots emitted a token, the token, its depth, its logprob, and whether a
stop rule of the device ended the request) that is copied to host memory and read by `collect` a launch
later (docs/engine.md).

The runner's jobs are split by module: host transfers (`staging.py`), the plan's row changes
(`_apply_rows` here, writing through `DecodeState`'s methods), the prompt chunks' host layout
(`prompt_batch.py`), CUDA graphs (`cuda_graphs.py`) and the rounds themselves (here). The runner owns its
device state; the scheduler's `Sequence`s carry none.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from ..config import KVLayout
from ..model.attention import AttentionMetadata
from ..model.ouro import OuroModel
from ..model.sampler import SamplerMode
from ..outputs import FinishReason
from ..sampling_params import SamplingParams
from . import decode_state as ds
from .cuda_graphs import CudaGraphs, Graph, PromptInputs
from .decode_state import DecodeInputs, DecodeState, NewRow
from .deferred_deep import DeferredDeep, DeferredDeepConfig
from .exit_policy import ExitPolicy
from .kv_cache import KVCache
from .penalties import PenaltyState
from .prompt_batch import PromptBatch, prompt_batch
from .row_sampler import RowSampler
from .scheduler import PrefillChunk, SchedulerOutput
from .sequence import Sequence
from .speculation import REC_ACCEPTED, REC_DRAFTED, Speculator
from .staging import Staging
from .swap import SwapStore

log = logging.getLogger(__name__)

# The device's stop rules, by the record's REC_EMITTED value.
_DEVICE_STOPS = {ds.EMIT_EOS: FinishReason.STOP, ds.EMIT_LENGTH: FinishReason.LENGTH}


@dataclass
class Launch:
    """A launched plan: whom its slots belonged to and where its records land."""

    owners: list[Sequence | None]
    host: torch.Tensor | None = None  # fp32 [rounds, 4, slots], filled once `ready` fires
    speculative: bool = False  # the record's last round holds acceptance counts (speculation.py)
    ready: torch.cuda.Event | None = None
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
    # The device ended the request with this token: EOS ("stop") or max_tokens ("length").
    stop: FinishReason | None = None
    logits: torch.Tensor | None = None  # only when the runner records logits (tests, debugging)
    # On the first token a speculative step emitted for a request: the drafts it accepted in that step.
    spec_accepted: int | None = None


@dataclass
class AwaitsDeep:
    """Not a token: the request's row parked at a boundary and waits for its deferred deep chunk."""

    seq: Sequence


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
    deep_rounds: int = 0  # rounds with deferred deep chunks
    deep_rows: int = 0  # deep chunk tokens over those rounds (each chunk counts once per deep loop)


class LaunchTimer:
    """Device time of each launch while `enabled` (ouro-bench), from CUDA events around it."""

    def __init__(self, device: torch.device):
        self.device, self.enabled = device, False
        # (start, end, prompt tokens, decode rows, rounds, speculative) per launch
        self._windows: list[tuple[torch.cuda.Event, torch.cuda.Event, int, int, int, bool]] = []

    def start(self) -> torch.cuda.Event | None:
        if not (self.enabled and self.device.type == "cuda"):
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def end(self, start: torch.cuda.Event | None, plan: SchedulerOutput, rounds: int) -> None:
        if start is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            shape = (sum(c.n for c in plan.prefill), len(plan.decode_slots), rounds, plan.speculate)
            self._windows.append((start, end, *shape))

    def take(self) -> tuple[float, float, list[tuple[float, int, int, int, bool]]]:
        """(span, busy, launches) of the launches recorded since the last call: busy is the sum of each
        launch's device seconds, span runs from the first start to the last end, and `launches` lists each
        one's (device seconds, prompt tokens, decode rows, rounds, speculative). Waits for them."""
        wins, self._windows = self._windows, []
        if not wins:
            return 0.0, 0.0, []
        wins[-1][1].synchronize()
        launches = [(a.elapsed_time(b) / 1e3, *shape) for a, b, *shape in wins]
        return wins[0][0].elapsed_time(wins[-1][1]) / 1e3, sum(x[0] for x in launches), launches


class ModelRunner:
    def __init__(
        self,
        model: OuroModel,
        kv: KVCache,
        policy: ExitPolicy,
        num_slots: int,
        max_model_len: int,
        eos_ids: list[int],
        exit_threshold: float,
        spec_tokens: int = 0,
        spec_draft_loops: int = 1,
        deferred: DeferredDeepConfig | None = None,
    ):
        self.model, self.kv, self.policy = model, kv, policy
        self.exit_threshold = exit_threshold  # for requests that set none
        self.num_loops = model.cfg.num_loops
        self.device = dev = model.device
        self.max_model_len = max_model_len
        self.max_blocks = -(-(max_model_len + spec_tokens) // kv.block_size)  # drafts run past the last token
        # The state machine around the loop: fused Triton kernels with the graph-safe GPU backends, else
        # their torch twins.
        fused = dev.type == "cuda" and getattr(model.backend, "graph_safe", False)
        self.state = DecodeState(
            num_slots,
            self.num_loops,
            self.max_blocks,
            model.cfg.hidden_size,
            model.dtype,
            dev,
            block_size=kv.block_size,
            last_exited=kv.layout is KVLayout.LAST_EXITED,
            eos_ids=eos_ids,
            fused=fused,
        )
        self.staging = Staging(dev)
        self.penalties = PenaltyState(num_slots, model.cfg.vocab_size, dev, self.staging.to_device)
        self.sampler = RowSampler(self.state, self.penalties, model.cfg.vocab_size)
        self.swap = SwapStore(kv, self.state, self.penalties, self.staging.to_device)
        self.speculator = (
            Speculator(model, self.state, kv, self.sampler, spec_tokens, spec_draft_loops, max_model_len)
            if spec_tokens
            else None
        )
        self.deferred = (
            DeferredDeep(deferred, self.state, model.cfg.hidden_size, model.dtype) if deferred is not None else None
        )
        self.graphs: CudaGraphs | None = None  # set by capture_graphs
        self.stats = RunnerStats()
        self.timer = LaunchTimer(dev)
        self.record_logits = False
        self.last_round: dict[str, int] = {}  # the shape of the newest launch (round_trace, ouro-bench)
        # Host work to do while the GPU runs a launch (the engine process sends the previous step's outputs
        # here). It must not call into the engine.
        self.overlap: Callable[[], None] | None = None
        self._newest: Launch | None = None
        self._arange = torch.arange(num_slots + 1, dtype=torch.int64, device=dev)  # static: graphs index it
        # NOTE: the previous mixed round's prompt-token loop output and each chunk's first row in it, by slot.
        # A chunk past loop 1 always ran in the previous launch (the scheduler continues every chunk
        # mid-loops, and such a launch is a mixed round), so this is its input.
        self._prompt_out: tuple[torch.Tensor, dict[int, int]] | None = None

    # ---- launches ----
    @torch.inference_mode()
    def launch(self, plan: SchedulerOutput) -> Launch:
        """Enqueue the plan's device work and return without waiting for it."""
        self.staging.next_launch()
        start = self.timer.start()
        failed = self._apply_rows(plan)
        rounds = self._rounds(plan)
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
        self.timer.end(start, plan, rounds)
        launch.host, launch.ready = self.staging.readback(rec)
        self.stats.launches += 1
        self.stats.rounds += rounds
        self.last_round = dict(
            prefill_tokens=sum(c.n for c in plan.prefill),
            decode_rows=len(plan.decode_slots),
            rounds=rounds,
            running=sum(s is not None for s in plan.owners),
        )
        self._newest = launch
        return launch

    def _rounds(self, plan: SchedulerOutput) -> int:
        """Loops over all rows the launch runs."""
        if plan.speculate:
            assert self.speculator is not None  # the scheduler speculates only when spec_tokens > 0
            return self.speculator.rounds
        if not (plan.prefill or plan.decode_slots):
            return 0  # only rows to switch off: no round runs
        return 1 if plan.prefill or self.record_logits else plan.num_rounds

    def _apply_rows(self, plan: SchedulerOutput) -> list[tuple[Sequence, Exception]]:
        """Save the rows of preempted requests, switch off the rows of requests the host ended or preempted,
        bring resumed rows back, write the rows of admitted ones and extend the block tables that grew.

        Each request's own part (its swap copy, its restored row, its new row's host values) runs on its own:
        one that raises is returned with its exception, its row is switched off and its work is taken out of
        the plan, so the rounds run without it. The batched writes take only rows that staged."""
        failed: list[tuple[Sequence, Exception]] = []
        to = self.staging.to_device

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
        if plan.released:
            self.state.release(to(plan.released, torch.long))
        for si in plan.swap_in:
            own(si.seq, self.swap.restore, si.key, si.slot, si.tables)
        if plan.table_growth:
            slots, planes, index, blocks = zip(*plan.table_growth)
            self.state.extend_tables(
                to(list(slots), torch.long),
                to(list(planes), torch.long),
                to(list(index), torch.long),
                to(list(blocks), torch.int32),
            )
        staged = [(s.slot, row) for s in plan.admitted if (row := own(s, self._admission_row, s)) is not None]
        if staged:
            ints, floats, traces, tables = [], [], [], []
            for _, (i, f, tr, tb) in staged:
                ints += i
                floats += f
                traces += tr
                tables += tb
            self.state.admit(
                to([slot for slot, _ in staged], torch.long),
                to(ints, torch.long),
                to(floats, torch.float64),
                to(traces, torch.long),
                to(tables, torch.int32),
            )
        if failed:
            self._take_out(plan, [seq for seq, _ in failed])
        return failed

    def _admission_row(self, seq: Sequence) -> tuple[list, list, list, list]:
        """An admitted request's host values for `DecodeState.admit` (raises for a value its row cannot hold),
        once its penalty row is written."""
        p = seq.params
        assert seq.slot is not None  # admitted: it holds a slot
        self.penalties.admit(seq.slot, p, seq.prompt_ids, seq.output_ids, seq.bad_word_ids)
        row = NewRow(
            seq.slot,
            len(seq.prompt_ids),
            p,
            *self._row_depth(p),
            seq.seed,
            seq.block_tables,
            (seq.output_ids[-1], len(seq.output_ids)) if seq.resuming else None,
        )
        return DecodeState.host_row(row, self.num_loops, self.max_blocks)

    def _row_depth(self, p: SamplingParams) -> tuple[int, float]:
        """A request's (max_loops, threshold) row values: its own or the engine's, or under deferred deep
        batching the mode's fixed depth (add_request refuses requests that set their own)."""
        if self.deferred is not None:
            return self.deferred.row_max_loops(), 1.0
        return p.max_loops or self.num_loops, self.exit_threshold if p.exit_threshold is None else p.exit_threshold

    def _take_out(self, plan: SchedulerOutput, gone: list[Sequence]) -> None:
        """Switch the rows of `gone` off and drop their prompt chunks and decode rows from the plan."""
        slots = [seq.slot for seq in gone if seq.slot is not None]  # a request swapped out has none
        if slots:
            self.state.release(self.staging.to_device(slots, torch.long))
        ids = {id(seq) for seq in gone}
        plan.prefill = [c for c in plan.prefill if id(c.seq) not in ids]
        plan.decode_slots = [s for s in plan.decode_slots if id(plan.owners[s]) not in ids]
        plan.speculate = plan.speculate and bool(plan.decode_slots)

    def _graph_rows(self, plan: SchedulerOutput) -> list[int] | None:
        return self.graphs.bind_rows(plan.decode_slots, plan.owners) if self.graphs is not None else None

    def _replayable(self, graph: Graph | None) -> Graph | None:
        """`graph`, unless logits are recorded and it was captured with the fused coda, which makes none (then
        the launch runs eagerly)."""
        return None if graph is not None and self.record_logits and graph.logits is None else graph

    def _spec_launch(self, plan: SchedulerOutput) -> torch.Tensor:
        spec = self.speculator
        assert spec is not None  # the scheduler speculates only when spec_tokens > 0
        self.stats.spec_steps += 1
        rows = self._graph_rows(plan)
        graph = self.graphs.spec.get((len(rows), plan.sampler)) if self.graphs is not None and rows else None
        if graph is not None:
            graph.graph.replay()
            self.stats.graph_launches += 1
            return graph.rec
        rec = spec.new_record()
        spec.step(self.staging.to_device(plan.decode_slots, torch.long), rec, plan.sampler)
        self.stats.eager_launches += 1
        return rec

    def _decode_launch(self, plan: SchedulerOutput, launch: Launch, rounds: int) -> torch.Tensor:
        rows = self._graph_rows(plan)
        graph = self.graphs.decode.get((len(rows), rounds, plan.sampler)) if self.graphs is not None and rows else None
        graph = self._replayable(graph)
        if graph is not None:
            graph.graph.replay()
            self.stats.graph_launches += 1
            if self.record_logits:  # one round a launch then: the graph keeps the last round's logits
                assert rows is not None and graph.logits is not None  # a decode graph was picked for these rows
                launch.logits.append([(rows, graph.logits.float().clone())])
            return graph.rec
        rec = self.state.new_record(rounds)
        logits = self._decode_steps(self.staging.to_device(plan.decode_slots, torch.long), rec, plan.sampler)
        if self.record_logits:  # one round a launch then
            assert logits is not None  # rounds >= 1
            launch.logits.append([(plan.decode_slots, logits.float())])
        self.stats.eager_launches += 1
        return rec

    def _mixed_round(self, plan: SchedulerOutput, launch: Launch) -> torch.Tensor:
        """A round with prompt chunks (and the decode rows, if any): one loop over all their tokens. With
        graphs, the decode rows are every slot (idle ones masked) and the prompt tokens a token bucket."""
        chunks = plan.prefill
        N = sum(c.n for c in chunks)
        deep = sum(c.n for c in chunks if c.deep)
        if deep:
            self.stats.deep_rounds += 1
            self.stats.deep_rows += deep
        picked = (
            self.graphs.mixed_graph(N, len(chunks), plan.sampler, plan.decode_slots, plan.owners)
            if self.graphs is not None
            else None
        )
        graph, graph_slots = picked if picked is not None else (None, [])
        graph = self._replayable(graph)
        D = graph.rows if graph is not None else len(plan.decode_slots)
        batch = prompt_batch(chunks, self.kv, D, self.max_blocks)
        h = self._prompt_hidden(chunks, batch)
        if graph is not None:
            out, logits, rec = self._replay_mixed(graph, batch, h)
            dec_slots = graph_slots
        else:
            out, logits, rec = self._run_mixed(plan, batch, h)
            dec_slots = plan.decode_slots
        if batch.fill_src:
            to = self.staging.to_device
            self.model.backend.copy_kv_slots(self.kv.kv, to(batch.fill_src, torch.long), to(batch.fill_dst, torch.long))
        round_logits: list[tuple[list[int], torch.Tensor]] = []
        if D and logits is not None:  # (None after the fused coda, never when logits are recorded)
            round_logits.append((dec_slots, logits))
        round_logits += self._finish_prompts(chunks, out, batch, rec[0], plan.sampler)
        unfinished = any(c.loop < self.num_loops for c in chunks)
        self._prompt_out = (out, {c.slot: batch.first_row[i] for i, c in enumerate(chunks)}) if unfinished else None
        if self.record_logits:
            launch.logits.append([(s, lg.float().clone()) for s, lg in round_logits])
        return rec

    def _prompt_hidden(self, chunks: list[PrefillChunk], batch: PromptBatch) -> torch.Tensor:
        """The prompt tokens' loop input: embeddings at loop 1, else the previous round's loop output."""
        embedded = self.model.embed(self.staging.to_device(batch.loop1_ids, torch.long)) if batch.loop1_ids else None
        parts, used = [], 0
        for c in chunks:
            if c.loop == 1:
                assert embedded is not None  # loop-1 chunks put their tokens in `loop1_ids`
                parts.append(embedded[used : used + c.n])
                used += c.n
            elif c.deep and self.deferred is not None and c.loop == self.deferred.r + 1:
                parts.append(self.deferred.chunk_input(c.slot, c.n))
            else:
                assert self._prompt_out is not None  # see its NOTE
                out, first_row = self._prompt_out
                parts.append(out[first_row[c.slot] : first_row[c.slot] + c.n])
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def _replay_mixed(
        self, graph: Graph, batch: PromptBatch, h: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        assert self.graphs is not None and graph.out is not None  # a mixed graph
        to, N, P = self.staging.to_device, batch.num_tokens, len(batch.lens)
        pad_tokens, pad_chunks = graph.tokens - N, graph.prefill_rows - P
        pre = self.graphs.prompt_inputs(graph.tokens, graph.prefill_rows, graph.rows)
        pre.h[:N].copy_(h)
        pre.pos.copy_(to(batch.positions + [0] * pad_tokens, torch.long))
        pre.kv_slot.copy_(to(batch.kv_slots + [-1] * pad_tokens, torch.long))
        pre.cu.copy_(to(batch.cu + [batch.cu[-1]] * pad_chunks, torch.int32))
        pre.lens.copy_(to(batch.lens + [1] * pad_chunks, torch.int32))
        pre.tables[:P].copy_(to(batch.tables, torch.int32).view(P, self.max_blocks))
        graph.graph.replay()
        self.stats.graph_launches += 1
        return graph.out[:N].clone(), graph.logits, graph.rec

    def _run_mixed(
        self, plan: SchedulerOutput, batch: PromptBatch, h: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        to, P = self.staging.to_device, len(batch.lens)
        pre = PromptInputs(
            h,
            to(batch.positions, torch.long),
            to(batch.kv_slots, torch.long),
            to(batch.cu, torch.int32),
            to(batch.lens, torch.int32),
            to(batch.tables, torch.int32).view(P, self.max_blocks),
            batch.max_chunk,
            cu_host=batch.cu,
            lens_host=batch.lens,
        )
        rec = self.state.new_record(1)
        idx = to(plan.decode_slots, torch.long) if plan.decode_slots else None
        out, logits = self._mixed_step(idx, pre, rec[0], plan.sampler)
        self.stats.eager_launches += 1
        return out, logits, rec

    def _finish_prompts(
        self, chunks: list[PrefillChunk], out: torch.Tensor, batch: PromptBatch, rec: torch.Tensor, mode: SamplerMode
    ) -> list[tuple[list[int], torch.Tensor]]:
        """Chunks that end their prompt at the last loop: a resumed request's row starts decoding at the token
        it holds; the others sample their first token and become decode rows. Returns the latter's
        (slots, logits)."""
        T = self.num_loops
        done = [i for i, c in enumerate(chunks) if c.loop == T and not c.deep and c.start + c.n == c.seq.prefill_target]
        resumed = [chunks[i].slot for i in done if chunks[i].seq.resuming]
        if resumed:
            self.state.activate(self.staging.to_device(resumed, torch.long))
        # Deferred deep chunks at loop T read their request's boundary token out, as a prompt's first token.
        completing = [i for i in done if not chunks[i].seq.resuming]
        completing += [i for i, c in enumerate(chunks) if c.loop == T and c.deep]
        if not completing:
            return []
        to = self.staging.to_device
        slots = [chunks[i].slot for i in completing]
        idx = to(slots, torch.long)
        last = to([batch.first_row[i] + chunks[i].n - 1 for i in completing], torch.long)
        logits = self.model.logits(out.index_select(0, last))
        tok, lp = self.sampler.sample(idx, logits, mode)
        self.state.emit_first(idx, tok, lp, rec)
        if mode is SamplerMode.PENALIZE:
            self.penalties.record(idx, tok, torch.ones_like(idx, dtype=torch.bool))
        return [(slots, logits)]

    # ---- the rounds (eager, or inside a CUDA graph) ----
    def _decode_steps(self, idx: torch.Tensor, rec: torch.Tensor, mode: SamplerMode) -> torch.Tensor | None:
        """rec.shape[0] decode rounds over rows `idx`; returns the last round's logits."""
        logits = None
        for r in range(rec.shape[0]):
            rows = self.state.decode_inputs(idx, self.model.embed_tokens)
            out = self.model.loop(rows.h, rows.pos, self._decode_meta(rows), self.kv.kv)
            logits = self._advance_decode(idx, rows, out, rec[r], mode)
        return logits

    def _decode_meta(self, rows: DecodeInputs) -> AttentionMetadata:
        S = rows.pos.shape[0]
        return AttentionMetadata(
            self._arange[: S + 1].int(),
            rows.seq_lens,
            rows.tables,
            rows.kv_slot,
            max_seqlen_q=1,
            max_seqlen_k=self.max_model_len,
            cu_seqlens_q_host=list(range(S + 1)),
        )

    def _mixed_step(
        self, idx: torch.Tensor | None, pre: PromptInputs, rec: torch.Tensor, mode: SamplerMode
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One loop over decode rows `idx` (from the state; None: none) followed by prompt tokens `pre`;
        advances the decode rows and returns the prompt tokens' loop output and the decode rows' logits."""
        dec = self.state.decode_inputs(idx, self.model.embed_tokens) if idx is not None and idx.shape[0] else None
        if dec is None:
            meta = AttentionMetadata(
                pre.cu,
                pre.lens,
                pre.tables,
                pre.kv_slot,
                max_seqlen_q=pre.max_q,
                max_seqlen_k=self.max_model_len,
                cu_seqlens_q_host=pre.cu_host,
                seq_lens_host=pre.lens_host,
            )
            return self.model.loop(pre.h, pre.pos, meta, self.kv.kv), None
        assert idx is not None
        D = idx.shape[0]
        meta = AttentionMetadata(
            pre.cu,
            torch.cat([dec.seq_lens, pre.lens]),
            torch.cat([dec.tables, pre.tables]),
            torch.cat([dec.kv_slot, pre.kv_slot]),
            max_seqlen_q=pre.max_q,
            max_seqlen_k=self.max_model_len,
            cu_seqlens_q_host=pre.cu_host,
            decode_rows=D,
            cu_prefill=pre.cu[D:] - D,
        )
        out = self.model.loop(torch.cat([dec.h, pre.h]), torch.cat([dec.pos, pre.pos]), meta, self.kv.kv)
        return out[D:], self._advance_decode(idx, dec, out[:D], rec, mode)

    def _advance_decode(
        self, idx: torch.Tensor, rows: DecodeInputs, out: torch.Tensor, rec: torch.Tensor, mode: SamplerMode
    ) -> torch.Tensor | None:
        """After the loop: gate, coda, then exits, next steps and the LAST_EXITED fill; returns the logits
        (None after the fused coda, which makes none)."""
        lam = self.policy.gate_values(self.model, out) if self.policy.needs_gate else None
        logits: torch.Tensor | None = None
        if self._fused_coda(idx, mode):  # no logits tensor: the coda kernel reads the exit rule itself
            tok, lp = self.model.backend.greedy_coda(
                out, self.model.lm_head, self.state, idx, lam, self.policy.mode, ds.COLUMNS
            )
        else:
            logits = self.model.logits(out)
            tok, lp = self.sampler.sample(idx, logits, mode)
        marked = None
        if self.deferred is not None:
            tok, lp, marked = self.deferred.before_advance(self.state, idx, out, tok, lp)
        src, dst = self.state.advance(idx, lam, tok, lp, rows.kv_slots, rec, self.policy.mode)
        if mode is SamplerMode.PENALIZE:  # the rows that emitted a token this round, from the record
            self.penalties.record(idx, tok, rec[ds.REC_EMITTED].index_select(0, idx) > 0)
        if self.deferred is not None:
            assert marked is not None
            self.deferred.after_advance(idx, marked, rec)
        if self.state.last_exited and self.num_loops > 1:
            self.model.backend.copy_kv_slots(self.kv.kv, src.flatten(), dst.flatten())
        self.state.store_hidden(idx, out)
        return logits

    def _fused_coda(self, idx: torch.Tensor, mode: SamplerMode) -> bool:
        """Whether this round's coda runs as the backend's one greedy kernel: greedy rows, few of them, and
        nothing that reads the logits (recorded logits, deferred deep batching's marks)."""
        return (
            self.state.fused
            and mode is SamplerMode.GREEDY
            and getattr(self.model.backend, "greedy_coda", None) is not None
            and idx.shape[0] <= self.model.backend.fused_coda_max_rows
            and not self.record_logits
            and self.deferred is None
        )

    # ---- read-back ----
    @torch.inference_mode()
    def collect(self, launch: Launch) -> list[Emitted | AwaitsDeep]:
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
        rounds, slots = np.nonzero(rec[:, ds.REC_EMITTED])  # with EMIT_DEEP: rows that went to wait
        if launch.speculative:
            assert self.speculator is not None
            self.stats.spec_drafted += self.speculator.K * int(rec[-1, REC_DRAFTED].sum())
            self.stats.spec_accepted += int(rec[-1, REC_ACCEPTED].sum())
        out: list[Emitted | AwaitsDeep] = []
        for r, s in zip(rounds.tolist(), slots.tolist()):
            seq = launch.owners[s]
            assert seq is not None  # a slot that emitted was owned when the launch was planned
            if rec[r, ds.REC_EMITTED, s] == ds.EMIT_DEEP:
                out.append(AwaitsDeep(seq))
                continue
            logits = None
            if launch.logits:
                for owned, lg in launch.logits[r]:
                    if s in owned:
                        logits = lg[owned.index(s)].cpu()
            emitted = Emitted(
                seq,
                int(rec[r, ds.REC_TOKEN, s]),
                float(rec[r, ds.REC_LOGPROB, s]),
                int(rec[r, ds.REC_DEPTH, s]),
                _DEVICE_STOPS.get(int(rec[r, ds.REC_EMITTED, s])),
                logits,
            )
            if launch.speculative and r == 0:  # every row a step drafted for emits its token 0
                emitted.spec_accepted = int(rec[-1, REC_ACCEPTED, s])
            out.append(emitted)
        return out

    # ---- CUDA graphs ----
    @torch.inference_mode()
    def capture_graphs(self, max_rows: int, max_graph_tokens: int, rounds_per_launch: int) -> None:
        """Capture the launches' CUDA graphs (`cuda_graphs.py`): decode-only launches per row bucket x {1,
        rounds_per_launch} rounds x sampler mode, speculative steps per row bucket, and rounds with prompt
        chunks per prompt-token bucket beside all `max_rows` slots (and beside `FEW_ROWS` bound rows for small
        buckets)."""
        cfg = self.model.cfg
        graphs = CudaGraphs(
            self.state,
            cfg.hidden_size,
            self.model.lm_head.shape[0],
            self.model.dtype,
            max_rows,
            max_graph_tokens,
            self.staging,
        )
        # Compile the exit-fill kernel now, not in the middle of the first early exit (a self-copy of slot 0).
        zero = torch.zeros(1, dtype=torch.long, device=self.device)
        self.model.backend.copy_kv_slots(self.kv.kv, zero, zero)
        spec = self.speculator
        graphs.capture(
            self._mixed_step,
            self._decode_steps,
            spec.step if spec is not None else None,
            spec.K + 2 if spec is not None else 0,
            rounds_per_launch,
        )
        self.graphs = graphs
