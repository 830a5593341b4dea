"""Continuous depth batching (docs/engine.md): the scheduler owns every request's host-side state.

Each step it plans one launch (`SchedulerOutput`) with explicit kinds of work:

* DECODE rows: every running request past its prompt has one token in flight on the device, at some
  loop; its row lives in the runner's decode state, which advances it and decides its exits without the
  host. The scheduler only says how many slots the decode rows span. Early exit turns into throughput
  because a row whose token exits starts the next token at loop 1 in the very next round.
* PREFILL chunks: prompts run in chunks at full depth (one loop a round), interleaved with decode under
  `max_num_batched_tokens`; the host tracks their loops (they are deterministic).
* DEFERRED DEEP chunks (`deferred_deep_interval` B > 0, docs/engine.md): a row parked at a boundary gets a
  chunk of its last B positions at the deep loops (a `PrefillChunk` with `deep=True`), run like a prompt chunk.
* SPECULATIVE steps (`spec_tokens` > 0, docs/engine.md): a launch with no prompt work may draft K tokens per
  decode row with the first d loops and verify them at full depth, when the speculation policy says it
  pays. A step recomputes each row's current token from loop 1, so a row may enter it mid-token (after
  mixed or plain rounds); otherwise decode launches are the plain engine's.

Admission is first-come-first-served, bounded by `max_num_seqs` (the slots) and by KV capacity: a request
gets its prompt's blocks and a few launches of decode room, and its decode planes grow as the host learns
its tokens (docs/kv-memory.md). When running requests cannot grow, the newest are preempted: freed and
requeued at the head of the queue to be prefilled again at their recorded exit depths (recompute), or
their KV and decode rows moved to host memory (SWAPPED) until blocks are free again. A launch with no prompt
work and nobody waiting runs several decode rounds (`decode_rounds_per_launch`).

The host follows the device a launch or more behind: `RunnerOutput` tokens are appended by the engine,
which finishes requests on stop strings, stop tokens, EOS and max_tokens; the next plan releases their
slots on the device. Tokens the device produced past a request's end are dropped.
"""

from __future__ import annotations

import heapq
import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import cast

from ..config import EngineConfig, KVLayout
from ..model.sampler import SamplerMode
from ..outputs import FinishReason
from .kv_cache import KVCache
from .sequence import Sequence, Status
from .spec_policy import SpecPolicy

log = logging.getLogger(__name__)


@dataclass
class PrefillChunk:
    """Prompt tokens [start, start + n) of one request, at `loop` this round (they run all T loops).

    `deep`: a deferred deep chunk instead (deferred deep batching): the request's last n positions, from
    loop r+1 (their retained loop-r states) to T; at loop T it reads out the request's boundary token."""

    seq: Sequence
    start: int
    n: int
    loop: int = 1
    deep: bool = False

    @property
    def slot(self) -> int:
        slot = self.seq.slot
        assert slot is not None  # a chunk's request is running: it holds its slot until the chunk is dropped
        return slot


@dataclass
class SwapOut:
    """Preempted: copy the row of `slot` and these blocks (plane by plane, `counts` per plane) to host
    memory under `key`, before the launch switches the row off."""

    seq: Sequence
    slot: int
    blocks: list[int]
    counts: list[int]

    @property
    def key(self) -> str:
        return self.seq.request_id


@dataclass
class SwapIn:
    """Resumed: the saved row goes to `slot`; plane p's saved blocks go to `tables[p][:counts[p]]`."""

    seq: Sequence
    slot: int
    tables: list[list[int]]

    @property
    def key(self) -> str:
        return self.seq.request_id


def _sampler_mode(running: Iterable[Sequence]) -> SamplerMode:
    """The sampler a launch over these requests needs: the cheapest mode that serves every one of them."""
    mode = SamplerMode.GREEDY
    for s in running:
        if s.params.processes_logits:
            return SamplerMode.PENALIZE
        if s.params.temperature > 0:
            mode = SamplerMode.SAMPLE
    return mode


@dataclass(kw_only=True)
class SchedulerOutput:
    """One launch's plan. The runner turns it into device work; the host state stays here."""

    prefill: list[PrefillChunk]
    decode_slots: list[int]  # slots of the running decode rows (their rows are on the device)
    num_rounds: int = 1  # > 1 only with no prefill work: several decode rounds in one launch
    admitted: list[Sequence] = field(default_factory=list)  # device rows to write before the round
    released: list[int] = field(default_factory=list)  # slots to switch off before the round
    sampler: SamplerMode = SamplerMode.GREEDY
    owners: list[Sequence | None] = field(default_factory=list)  # slot -> request, at launch time
    speculate: bool = False  # the decode rows run one speculative step (draft K, verify) instead of rounds
    swap_out: list[SwapOut] = field(default_factory=list)  # done first, before rows are released
    swap_in: list[SwapIn] = field(default_factory=list)  # done after the releases, before admissions
    swap_dropped: list[str] = field(default_factory=list)  # saved rows of requests that ended while swapped
    table_growth: list[tuple[int, int, int, int]] = field(default_factory=list)  # (slot, plane, index, block)

    @property
    def has_work(self) -> bool:
        return bool(
            self.prefill
            or self.decode_slots
            or self.released
            or self.admitted
            or self.swap_out
            or self.swap_in
            or self.swap_dropped
        )


class Scheduler:
    def __init__(self, cfg: EngineConfig, kv: KVCache, num_loops: int):
        self.max_num_seqs = cfg.max_num_seqs
        self.max_tokens = cfg.max_num_batched_tokens
        self.chunk = cfg.prefill_chunk_size or cfg.max_num_batched_tokens
        self.decode_rounds = cfg.decode_rounds_per_launch
        self.spec_tokens = cfg.spec_tokens
        self.spec_policy = (
            SpecPolicy(cfg.spec_tokens, cfg.spec_draft_loops, num_loops, cfg.spec_auto, cfg.spec_max_verify_tokens)
            if cfg.spec_tokens
            else None
        )
        self.kv = kv
        self.pool = kv.pool
        self.num_loops = num_loops
        # Positions a row may write beyond what the host knows: the launch in flight and the one being planned
        # each advance it by up to max(rounds, K + 1) tokens, and drafts write K past the last of them.
        self.lookahead = 2 * max(cfg.decode_rounds_per_launch, cfg.spec_tokens + 1) + cfg.spec_tokens
        self.watermark = int(cfg.kv_watermark * kv.num_blocks)
        self.swap_budget = int(cfg.swap_space_gib * 2**30)
        mode = cfg.preemption_mode
        self.swap_first = mode == "swap" or (mode == "auto" and kv.layout is KVLayout.SHARED)
        self.swap_used = 0
        self.num_preemptions = 0
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the newest is preempted first
        self.swapped: deque[Sequence] = deque()  # preempted, oldest first
        self.num_recomputes = 0  # preemptions that freed the KV (the others swapped it out)
        self._swap_sizes: dict[str, tuple[list[int], int]] = {}  # request id -> (blocks per plane, bytes)
        self._dropped: list[str] = []
        # slot -> the prompt chunk in flight; keyed by `Sequence.slot`, which is set while the request runs
        self.chunks: dict[int | None, PrefillChunk] = {}
        # Deferred deep batching: slot -> the deep chunk of a row that waits for it, not started yet. B when
        # rows park for deep chunks (0: off, and in the eager control, which reserves whole KV too).
        self.deep_chunk_interval = cfg.deferred_deep_interval if not cfg.deferred_deep_eager else 0
        self.reserve_whole_kv = cfg.deferred_deep_interval > 0
        self.deep_loop = cfg.deferred_readout_loop + 1
        self.deep_waiting: dict[int, PrefillChunk] = {}
        self.free_slots = list(range(cfg.max_num_seqs))
        self.owners: list[Sequence | None] = [None] * cfg.max_num_seqs
        self._released: list[int] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    @property
    def num_unfinished(self) -> int:
        """Requests running, waiting or swapped out."""
        return len(self.running) + len(self.waiting) + len(self.swapped)

    def max_positions(self, prompt_len: int, max_tokens: int) -> int:
        """Positions whose KV a request may write: its drafts run up to spec_tokens past its last token."""
        return prompt_len + max_tokens + self.spec_tokens

    def _total_len(self, seq: Sequence) -> int:
        return self.max_positions(len(seq.prompt_ids), seq.params.max_tokens)

    def _horizon(self, seq: Sequence) -> int:
        """Positions the device may write for `seq` before the host plans again (see `lookahead`). Deferred
        deep batching and its eager control reserve them all at admission: their requests are never preempted
        (a parked row's retained states live only in the device's rows, and a recompute would rebuild the
        positions read out at loop r without their true deep KV)."""
        if self.reserve_whole_kv:
            return self._total_len(seq)
        return min(self._total_len(seq), seq.num_tokens + self.lookahead)

    def _grow_running(self, growth: list, swap_out: list[SwapOut]) -> None:
        """Give every decoding request blocks up to its horizon, oldest first; preempt the newest decoding
        request while blocks are short (possibly the one growing)."""
        for seq in list(self.running):
            if seq.status is not Status.RUNNING or seq.in_prefill:
                continue  # preempted below, or its prompt's blocks were given at admission
            horizon = self._horizon(seq)
            need = self.kv.growth_needed(seq.block_tables, horizon)
            if not need:  # most steps: its tables already reach the horizon
                continue
            # NOTE preempting others frees blocks but leaves seq's tables, so `need` stands
            while need > self.pool.num_available:
                victim = next(s for s in reversed(self.running) if not s.in_prefill and s.slot not in self.chunks)
                self._preempt(victim, swap_out)
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                growth += [(seq.slot, *g) for g in self.kv.grow(seq.block_tables, horizon)]

    def _preempt(self, seq: Sequence, swap_out: list[SwapOut]) -> None:
        counts = [len(t) for t in seq.block_tables]
        size = sum(counts) * self.kv.block_bytes
        slot = seq.slot
        assert slot is not None  # a running request
        self.running.remove(seq)
        self._release_slot(seq)
        self.num_preemptions += 1
        if not self.swap_first or self.swap_used + size > self.swap_budget:
            # Recompute: back to the head of the queue with no KV. Tokens of the launch in flight still come
            # back and are kept; readmission (a later step) prefills up to the last of them.
            if self.kv.layout is KVLayout.SHARED:
                log.warning(
                    "request %s: preempted for recompute, which under the shared layout is not exact "
                    "(docs/kv-memory.md)",
                    seq.request_id,
                )
            self._free_kv(seq)
            seq.status = Status.WAITING
            seq.num_prefilled = 0
            self.waiting.appendleft(seq)
            self.num_recomputes += 1
            return
        swap_out.append(SwapOut(seq, slot, [b for t in seq.block_tables for b in t], counts))
        self._free_kv(seq)  # the copy to host is enqueued before any later launch reuses them
        self.swap_used += size
        self._swap_sizes[seq.request_id] = (counts, size)
        seq.status = Status.SWAPPED
        self.swapped.append(seq)

    def _swap_in(self, swap_in: list[SwapIn]) -> None:
        """Bring preempted requests back, oldest first, while slots and blocks (above the watermark) allow."""
        while self.swapped and self.free_slots:
            seq = self.swapped[0]
            counts, size = self._swap_sizes[seq.request_id]
            want = self.kv.blocks_for(self._horizon(seq))
            planes = set(self.kv.decode_planes())
            need = [max(c, want) if p in planes else c for p, c in enumerate(counts)]
            if sum(need) > self.pool.num_available - (self.watermark if self.running else 0):
                return
            self.swapped.popleft()
            del self._swap_sizes[seq.request_id]
            self.swap_used -= size
            blocks = iter(self.pool.take(sum(need)))
            seq.block_tables = [[next(blocks) for _ in range(n)] for n in need]
            self._take_slot(seq)
            assert seq.slot is not None
            swap_in.append(SwapIn(seq, seq.slot, seq.block_tables))

    def _take_slot(self, seq: Sequence) -> None:
        seq.status = Status.RUNNING
        seq.slot = heapq.heappop(self.free_slots)
        self.owners[seq.slot] = seq
        self.running.append(seq)

    def _release_slot(self, seq: Sequence) -> None:
        slot = seq.slot
        assert slot is not None  # only running requests are released
        self.chunks.pop(slot, None)
        self.deep_waiting.pop(slot, None)
        self._released.append(slot)
        self.owners[slot] = None
        heapq.heappush(self.free_slots, slot)
        seq.slot = None

    def schedule(self) -> SchedulerOutput:
        growth: list[tuple[int, int, int, int]] = []
        swap_out: list[SwapOut] = []
        swap_in: list[SwapIn] = []
        before = self.num_preemptions
        self._grow_running(growth, swap_out)
        preempted = self.num_preemptions > before
        if not preempted:  # a step that preempts does not resume anyone (no thrashing)
            self._swap_in(swap_in)
        # Running requests hold slots (no per-row check on this path). A row parked for its deep chunk is idle:
        # it takes no decode row, so its chunk can always get budget once enough rows have parked. NOTE a request
        # that ends with its prompt (max_tokens 1) takes none either while its token is on its way back (this
        # plan is made before that read-back under asynchronous scheduling); the device has stopped its row.
        decode = cast(
            "list[int]",
            [
                s.slot
                for s in self.running
                if s.slot not in self.chunks
                and s.slot not in self.deep_waiting
                and not s.in_prefill
                and not s.ends_with_its_prompt
            ],
        )
        budget = self.max_tokens - len(decode)
        # NOTE chunk order: chunks mid-loops, deep chunks, the running prompts' next chunks, then new prompts. So
        # the chunks that continue a prompt (most keys: their earlier tokens are cached) come first, and the
        # prompt attention's packed grid, which starts rows in order (`attention._paged_attn_kernel`), starts
        # their tiles in its first wave.
        prefill: list[PrefillChunk] = []
        for seq in self.running:
            chunk = self.chunks.get(seq.slot)
            if chunk is not None:  # mid-loops: always continues
                budget -= chunk.n
                prefill.append(chunk)
        for slot, deep in list(self.deep_waiting.items()):  # oldest first; a deep chunk is never split
            if deep.n <= budget:
                budget -= deep.n
                del self.deep_waiting[slot]
                self.chunks[slot] = deep
                prefill.append(deep)
        for seq in self.running:
            if seq.slot not in self.chunks and seq.in_prefill and budget > 0:
                budget -= self._start_chunk(seq, budget, prefill)
        admitted = []
        # A step that preempted admits nobody: a request preempted for recompute may still have tokens in
        # flight, and its prefill must reach the last of them.
        while self.waiting and not self.swapped and not preempted and self.free_slots and budget > 0:
            seq = self.waiting[0]
            seq.prefill_target = len(seq.prompt_ids) + max(0, len(seq.output_ids) - 1)
            hits = self._prefix_hits(seq)
            need = self.kv.blocks_needed(seq.prefill_target, self._horizon(seq)) - len(hits) * self.num_loops
            available = self.pool.num_available - self.pool.idle_blocks(hits)
            # The watermark keeps room for running requests to grow; alone, a request may take everything.
            if need > available - (self.watermark if self.running else 0):
                break  # FCFS: later requests wait too, so the head cannot starve
            self.waiting.popleft()
            shared = self.pool.acquire(hits)
            seq.block_tables = self.kv.allocate(seq.prefill_target, self._horizon(seq), shared)
            seq.cached_keys = list(hits)
            seq.num_prefilled = len(hits) * self.kv.block_size
            if self.pool.enable_prefix_caching and not seq.resuming:
                seq.num_cached_tokens = seq.num_prefilled
                self.pool.record(len(seq.prompt_ids), seq.num_prefilled)
            self._take_slot(seq)
            admitted.append(seq)
            budget -= self._start_chunk(seq, budget, prefill)
        # Several rounds per launch only when nothing waits on the host: no prompt work, nobody queued, and
        # every request's first token read back (TTFT would otherwise wait for a whole launch more).
        multi = decode and not prefill and not self.waiting and all(s.output_ids for s in self.running)
        rounds = self.decode_rounds if multi else 1
        released, self._released = self._released, []
        sampler = _sampler_mode(self.running)
        # (spec_policy is set exactly when spec_tokens > 0.) Penalties and bad words are not speculated: drafts
        # would need counts and tails that include the drafts before them, so such a batch decodes plainly.
        speculate = bool(
            self.spec_policy is not None
            and decode
            and not prefill
            and sampler is not SamplerMode.PENALIZE
            and self.spec_policy.decide(len(decode))
        )
        if speculate:
            rounds = 1
        dropped, self._dropped = self._dropped, []
        return SchedulerOutput(
            prefill=prefill,
            decode_slots=decode,
            num_rounds=rounds,
            admitted=admitted,
            released=released,
            sampler=sampler,
            owners=list(self.owners),
            speculate=speculate,
            swap_out=swap_out,
            swap_in=swap_in,
            swap_dropped=dropped,
            table_growth=growth,
        )

    def _prefix_hits(self, seq: Sequence) -> list[bytes]:
        """Cached leading blocks of the prompt, keeping at least its last token to compute (its logits give
        the first output token)."""
        if not self.pool.enable_prefix_caching:
            return []
        if seq.prompt_keys is None:
            seq.prompt_keys = self.pool.keys(seq.prompt_ids)
        return self.pool.match(seq.prompt_keys[: (len(seq.prompt_ids) - 1) // self.kv.block_size])

    def _register_prefix(self, seq: Sequence) -> None:
        """The prompt's full blocks, computed now, become cache entries this request holds, in order, up to
        the first whose key another request registered meanwhile (its blocks stay private)."""
        keys = seq.prompt_keys or []
        for i in range(len(seq.cached_keys), len(keys)):
            if not self.pool.insert(keys[i], tuple(t[i] for t in seq.block_tables)):
                return
            seq.cached_keys.append(keys[i])

    def _free_kv(self, seq: Sequence) -> None:
        self.kv.free(seq.block_tables, keep=len(seq.cached_keys))
        self.pool.release(seq.cached_keys)
        seq.cached_keys = []

    def _start_chunk(self, seq: Sequence, budget: int, prefill: list[PrefillChunk]) -> int:
        n = min(seq.prefill_target - seq.num_prefilled, self.chunk, budget)
        chunk = PrefillChunk(seq, seq.num_prefilled, n)
        self.chunks[seq.slot] = chunk
        prefill.append(chunk)
        return n

    def launched(self, plan: SchedulerOutput) -> None:
        """The plan's chunks ran (the runner takes out those of requests whose staging failed): each moves one
        loop on; a chunk past its last loop is done. Call once per launched plan, before the next schedule."""
        for c in plan.prefill:
            if c.loop < self.num_loops:
                self.chunks[c.slot] = PrefillChunk(c.seq, c.start, c.n, c.loop + 1, c.deep)
                continue
            del self.chunks[c.slot]
            if c.deep:  # its row has its boundary token and decodes on
                continue
            c.seq.num_prefilled = c.start + c.n
            if not c.seq.in_prefill:
                self.kv.release_prefill_planes(c.seq.block_tables)
                if self.pool.enable_prefix_caching:
                    self._register_prefix(c.seq)

    def wait_for_deep(self, seq: Sequence) -> None:
        """The device parked `seq`'s row at a boundary (deferred deep batching): queue its deep chunk, the
        positions of its last B tokens' inputs. Its tokens so far are all appended (records are read in
        order), so it has generated a multiple of B."""
        B, n = self.deep_chunk_interval, len(seq.output_ids)
        assert B and n % B == 0 and seq.slot is not None and seq.status is Status.RUNNING, (B, n, seq.status)
        start = len(seq.prompt_ids) + n - B
        self.deep_waiting[seq.slot] = PrefillChunk(seq, start, B, self.deep_loop, deep=True)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            self._release_slot(seq)
            self._free_kv(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        elif seq.status is Status.SWAPPED:  # its blocks went back when it was preempted
            self.swapped.remove(seq)
            self.swap_used -= self._swap_sizes.pop(seq.request_id)[1]
            self._dropped.append(seq.request_id)
        seq.finish(reason)

    def find(self, request_id: str) -> Sequence | None:
        for seq in (*self.running, *self.waiting, *self.swapped):
            if seq.request_id == request_id:
                return seq
        return None
