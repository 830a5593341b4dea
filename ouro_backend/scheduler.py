"""Continuous depth batching (DESIGN section 3).

Every round, each running sequence contributes at most one work item and every item advances one loop.
Items already in flight (mid-loops) always continue; a sequence whose token just exited starts its next
token at loop 1 in the very next round, taking the row its exit freed, so skipped loops turn into
throughput. Prompts run in chunks at full depth, interleaved with decode under `max_num_batched_tokens`;
admission is first-come-first-served, bounded by `max_num_seqs` and by KV capacity.
"""
from __future__ import annotations

import functools
from collections import deque
from typing import Optional

from .config import EngineConfig, ExitMode
from .exit_policy import ExitBounds
from .kv_cache import KVCache
from .sequence import Sequence, Status, WorkItem


@functools.lru_cache(maxsize=4096)
def _bounds(min_loops: int, max_loops: int, threshold: float, trace_depth: Optional[int]) -> ExitBounds:
    return ExitBounds(min_loops, max_loops, threshold, trace_depth)  # immutable: shared by every token


class Scheduler:
    def __init__(self, cfg: EngineConfig, kv: KVCache, num_loops: int, exit_threshold: float):
        self.max_num_seqs = cfg.max_num_seqs
        self.max_tokens = cfg.max_num_batched_tokens
        self.chunk = cfg.prefill_chunk_size or cfg.max_num_batched_tokens
        self.exit_mode = ExitMode(cfg.exit_mode)
        self.kv = kv
        self.num_loops = num_loops
        self.exit_threshold = exit_threshold
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _total_len(self, seq: Sequence) -> int:
        return len(seq.prompt_ids) + seq.params.max_tokens

    def schedule(self) -> list[Sequence]:
        budget = self.max_tokens
        batch = [s for s in self.running if s.item is not None]
        budget -= sum(s.item.n for s in batch)
        for seq in self.running:
            # A sequence whose last token reaches max_tokens is finished when that token is read back.
            if seq.item is None and not seq.in_prefill and seq.num_generated < seq.params.max_tokens:
                seq.item = self._decode_item(seq)
                batch.append(seq)
                budget -= 1
        for seq in self.running:
            if seq.item is None and seq.in_prefill and budget > 0:
                budget -= self._start_chunk(seq, budget)
                batch.append(seq)
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            if not self.kv.can_allocate(len(seq.prompt_ids), self._total_len(seq)):
                break  # FCFS: later requests wait too, so the head cannot starve
            self.waiting.popleft()
            seq.block_tables = self.kv.allocate(len(seq.prompt_ids), self._total_len(seq))
            seq.status = Status.RUNNING
            self.running.append(seq)
            budget -= self._start_chunk(seq, budget)
            batch.append(seq)
        return batch

    def _start_chunk(self, seq: Sequence, budget: int) -> int:
        n = min(len(seq.prompt_ids) - seq.num_prefilled, self.chunk, budget)
        seq.item = WorkItem(start=seq.num_prefilled, n=n, is_prefill=True)
        return n

    def _decode_item(self, seq: Sequence) -> WorkItem:
        p = seq.params
        trace_depth: Optional[int] = None
        if self.exit_mode is ExitMode.TRACE:
            trace = p.exit_trace or [p.max_loops or self.num_loops]
            trace_depth = trace[(seq.num_generated - 1) % len(trace)]
        bounds = _bounds(p.min_loops, p.max_loops or self.num_loops,
                         self.exit_threshold if p.exit_threshold is None else p.exit_threshold, trace_depth)
        return WorkItem(start=seq.num_tokens - 1, n=1, is_prefill=False, bounds=bounds,
                        token_src=seq.token_src)

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq.block_tables)
        seq.finish(reason)

    def find(self, request_id: str) -> Optional[Sequence]:
        for seq in (*self.running, *self.waiting):
            if seq.request_id == request_id:
                return seq
        return None
