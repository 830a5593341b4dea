"""CUDA graphs of the runner's launches: capture, the static inputs they read, and which one a plan replays.

Decode-only launches are captured per (row bucket, rounds per launch, sampler mode), state update and
coda included; speculative steps per (row bucket, sampler mode), PENALIZE aside (the scheduler does not
speculate then); rounds with prompt chunks per (decode rows, prompt-token bucket, sampler mode)
(`mixed_rows`): every slot as a decode row (idle ones masked by the decode state), and for small buckets
also `FEW_ROWS` bound rows, so a round with a small chunk beside a few live rows does not pay for every
slot. Prompt tokens are padded to the bucket (pad tokens get KV slot -1: no write).

A row graph of b rows (decode, speculative, or a mixed graph of `FEW_ROWS`) runs the slots in `rows[:b]`
(`bind_rows`), so a plan's decode rows need not be a slot range.

NOTE: every graph writes its outputs (the prompt tokens' loop output, the decode rows' logits) into
buffers all graphs share, so a launch must read its graph's outputs before the next launch replays
another; in exchange the graphs' own intermediates are free to the next capture (docs/engine.md,
"Measurements behind the design": graph memory).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

import torch

from ..model.sampler import SamplerMode
from .decode_state import DecodeState
from .staging import Staging


@dataclass
class PromptInputs:
    """A round's prompt tokens (after the decode rows): the loop's inputs and metadata."""

    h: torch.Tensor
    pos: torch.Tensor
    kv_slot: torch.Tensor
    cu: torch.Tensor  # int32 [decode rows + prompt chunks + 1]
    lens: torch.Tensor  # int32 [prompt chunks]
    tables: torch.Tensor  # int32 [prompt chunks, max_blocks]
    max_q: int
    cu_host: list[int] | None = None
    lens_host: list[int] | None = None


@dataclass
class Graph:
    graph: torch.cuda.CUDAGraph
    tokens: int  # prompt tokens (mixed graphs)
    rows: int  # decode rows
    rec: torch.Tensor  # [rounds, 4, slots] records
    logits: torch.Tensor | None  # the last round's decode-row logits [rows, V] (None: speculative graphs)
    out: torch.Tensor | None = None  # mixed graphs: [tokens, H] loop output of the prompt tokens
    prefill_rows: int = 0  # mixed graphs: prompt chunks it can take


# What the graphs capture: the runner's round functions, each writing its record `rec`.
MixedStep = Callable[
    [torch.Tensor, PromptInputs, torch.Tensor, SamplerMode], tuple[torch.Tensor, torch.Tensor | None]
]  # (rows, prompt, rec, mode) -> (out, logits)
DecodeSteps = Callable[[torch.Tensor, torch.Tensor, SamplerMode], torch.Tensor | None]  # -> logits
SpecStep = Callable[[torch.Tensor, torch.Tensor, SamplerMode], torch.Tensor]


# Mixed graphs of prompt-token buckets up to FEW_ROWS_TOKENS are captured twice: with every slot as a decode
# row and with FEW_ROWS bound rows (docs/engine.md, "Measurements behind the design").
FEW_ROWS = 16
FEW_ROWS_TOKENS = 512


def mixed_rows(max_rows: int, tokens: int) -> list[int]:
    """Decode-row counts of the mixed graphs of a prompt-token bucket, the every-slot count first, then bound
    rows: FEW_ROWS for small buckets when there are more slots than that. Capture and the pick
    (`CudaGraphs.mixed_graph`) both read it."""
    return [max_rows] + ([FEW_ROWS] if tokens <= FEW_ROWS_TOKENS and max_rows > FEW_ROWS else [])


def row_buckets(max_rows: int) -> list[int]:
    """Row counts of the decode and speculative graphs."""
    return sorted({b for b in (1, 2, 4, 8, *range(16, max_rows + 1, 16), max_rows) if b <= max_rows})


def token_buckets(max_tokens: int) -> list[int]:
    """Prompt-token counts of the mixed graphs: powers of two from 16, with quarter steps above 256."""
    return sorted(
        {
            t
            for p in range(4, 14)
            for t in ((1 << p),) + tuple((1 << p) + q * (1 << p) // 4 for q in range(1, 4) if p >= 8)
            if t <= max_tokens
        }
    )


def graph_rows(decode_slots: list[int], owners: list, sizes: list[int]) -> list[int] | None:
    """The slots a row graph runs for these decode rows: the smallest size b that holds them, the decode
    slots first, then free slots (owner None; idle on the device, so masked) as padding. With too few free
    slots to pad with, a slot range that covers every row. None when no size holds the rows (the launch
    then runs eagerly). Indexing rows, not a slot range, matters as a closed run drains: its last few
    requests keep whatever slots they had, and a range up to the highest would pay for every slot below."""
    n = len(decode_slots)
    fits = [b for b in sizes if b >= n]
    if not fits:
        return None
    b = min(fits)
    rows = list(decode_slots)
    if b > n:  # decode slots have owners, so the free slots are the others
        rows += [s for s, owner in enumerate(owners) if owner is None][: b - n]
    if len(rows) < b:
        span = max(decode_slots, default=-1) + 1
        ranged = [x for x in sizes if x >= span]
        return list(range(min(ranged))) if ranged else None
    return rows


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """A collection during a capture would run Python finalizers (and their CUDA frees) mid-capture and
    costs seconds over hundreds of captures: collect once, then pause the collector."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


class CudaGraphs:
    def __init__(
        self,
        state: DecodeState,
        hidden_size: int,
        vocab_size: int,
        dtype: torch.dtype,
        max_rows: int,
        max_graph_tokens: int,
        staging: Staging,
    ):
        dev = state.device
        self.state, self.staging, self.max_rows = state, staging, max_rows
        self.row_buckets = row_buckets(max_rows)
        self.token_buckets = token_buckets(max_graph_tokens)
        self.decode: dict[tuple[int, int, SamplerMode], Graph] = {}  # (rows, rounds, mode)
        self.mixed: dict[tuple[int, int, SamplerMode], Graph] = {}  # (decode rows, prompt tokens, mode)
        self.spec: dict[tuple[int, SamplerMode], Graph] = {}  # (rows, mode)
        self.memory = 0
        Tk = max(self.token_buckets, default=0)
        # Static inputs of the mixed graphs.
        self._h = torch.zeros(Tk, hidden_size, dtype=dtype, device=dev)
        self._pos = torch.zeros(Tk, dtype=torch.int64, device=dev)
        self._kv_slot = torch.full((Tk,), -1, dtype=torch.int64, device=dev)
        self._cu = torch.zeros(2 * max_rows + 1, dtype=torch.int32, device=dev)  # set per capture (`_empty_cu`)
        self._lens = torch.ones(max_rows, dtype=torch.int32, device=dev)
        self._tables = torch.zeros(max_rows, state.max_blocks, dtype=torch.int32, device=dev)
        # The slots that row graphs run (`bind_rows`); `_bound` mirrors it on the host.
        self._rows = torch.arange(max_rows, dtype=torch.int64, device=dev)
        self._bound = list(range(max_rows))
        self._all_rows = torch.arange(max_rows, dtype=torch.int64, device=dev)  # every-slot mixed graphs' rows
        # Every graph's outputs go to these shared buffers (module docstring).
        self._logits = torch.empty(max_rows, vocab_size, dtype=torch.float32, device=dev)
        self._out = torch.empty(Tk, hidden_size, dtype=dtype, device=dev)
        self._pool: torch.cuda._POOL_HANDLE | None = None  # the graphs' memory pool, from the first capture

    # ---- capture ----
    def capture(
        self,
        mixed_step: MixedStep,
        decode_steps: DecodeSteps,
        spec_step: SpecStep | None,
        spec_rounds: int,
        rounds_per_launch: int,
    ) -> None:
        """Capture every graph. `spec_step` None: no speculative graphs."""
        dev = self.state.device
        torch.cuda.synchronize(dev)
        # Reserved, not allocated: what a graph uses inside itself is free to the allocator after its
        # capture yet stays in the graphs' pool for its replays.
        before = torch.cuda.memory_reserved(dev)
        # NOTE each round function binds its bucket and mode when it is made (`partial`), not when it is called.
        with _collector_paused():
            R = self.max_rows
            for mode in SamplerMode:
                for t in reversed(self.token_buckets):
                    for d in mixed_rows(R, t):
                        idx = self._all_rows if d == R else self._rows[:d]
                        self._empty_cu(d)
                        pre = self.prompt_inputs(t, R, d)
                        fn = partial(self._mixed_round, mixed_step, idx, pre, mode)
                        g, rec, (out, logits) = self._capture(fn, 1)
                        self.mixed[(d, t, mode)] = Graph(g, t, d, rec, logits, out, R)
                for rounds in sorted({1, rounds_per_launch}, reverse=True):
                    for b in reversed(self.row_buckets):
                        fn = partial(self._decode_rounds, decode_steps, self._rows[:b], mode)
                        g, rec, (_, logits) = self._capture(fn, rounds)
                        self.decode[(b, rounds, mode)] = Graph(g, 0, b, rec, logits)
            if spec_step is not None:  # idle rows of a bucket are masked by the state, as above
                for mode in (SamplerMode.GREEDY, SamplerMode.SAMPLE):  # penalized batches never speculate
                    for b in reversed(self.row_buckets):
                        g, rec, _ = self._capture(
                            partial(self._spec_round, spec_step, self._rows[:b], mode), spec_rounds
                        )
                        self.spec[(b, mode)] = Graph(g, 0, b, rec, None)
        torch.cuda.synchronize(dev)
        self.memory = torch.cuda.memory_reserved(dev) - before

    def _mixed_round(
        self, mixed_step: MixedStep, idx: torch.Tensor, pre: PromptInputs, mode: SamplerMode, rec: torch.Tensor
    ) -> tuple:
        return self._shared_outputs(*mixed_step(idx, pre, rec[0], mode))

    def _decode_rounds(
        self, decode_steps: DecodeSteps, rows: torch.Tensor, mode: SamplerMode, rec: torch.Tensor
    ) -> tuple:
        return self._shared_outputs(None, decode_steps(rows, rec, mode))

    @staticmethod
    def _spec_round(spec_step: SpecStep, rows: torch.Tensor, mode: SamplerMode, rec: torch.Tensor) -> torch.Tensor:
        return spec_step(rows, rec, mode)

    def _shared_outputs(self, out: torch.Tensor | None, logits: torch.Tensor | None) -> tuple:
        """Inside a capture: copy the graph's outputs into the shared buffers (module docstring)."""
        if out is not None:
            out = self._out[: out.shape[0]].copy_(out)
        if logits is not None:
            logits = self._logits[: logits.shape[0]].copy_(logits)
        return out, logits

    def _capture(self, fn: Callable[[torch.Tensor], object], rounds: int):
        """Warm fn up (compile and autotune outside the capture; with idle rows nothing in the state
        changes), then capture it; returns (the graph, its record, what fn returned)."""
        for _ in range(2):
            fn(self.state.new_record(rounds))
        torch.cuda.synchronize(self.state.device)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self._pool):
            rec = self.state.new_record(rounds)
            result = fn(rec)
        self._pool = g.pool()
        return g, rec, result

    def _empty_cu(self, rows: int) -> None:
        """Capture-time cu_seqlens: `rows` decode rows of one token, then empty chunks (a replay writes the
        plan's over it)."""
        self._cu[: rows + 1].copy_(torch.arange(rows + 1, dtype=torch.int32))
        self._cu[rows + 1 :].fill_(rows)

    # ---- replay ----
    def prompt_inputs(self, tokens: int, chunks: int, rows: int) -> PromptInputs:
        """The mixed graphs' static prompt-token inputs, after `rows` decode rows."""
        return PromptInputs(
            self._h[:tokens],
            self._pos[:tokens],
            self._kv_slot[:tokens],
            self._cu[: rows + chunks + 1],
            self._lens[:chunks],
            self._tables[:chunks],
            tokens,
        )

    def bind_rows(self, decode_slots: list[int], owners: list, sizes: list[int] | None = None) -> list[int] | None:
        """Point the row graphs at these decode rows (`graph_rows` over `sizes`, by default the row buckets);
        returns the bound slots, or None."""
        rows = graph_rows(decode_slots, owners, self.row_buckets if sizes is None else sizes)
        if rows is not None and rows != self._bound[: len(rows)]:
            self._rows[: len(rows)].copy_(self.staging.to_device(rows, torch.long))
            self._bound[: len(rows)] = rows
        return rows

    def mixed_graph(
        self, tokens: int, chunks: int, mode: SamplerMode, decode_slots: list[int], owners: list
    ) -> tuple[Graph, list[int]] | None:
        """The mixed graph of the smallest bucket that holds `tokens` prompt tokens in `chunks` chunks: one of
        bound rows (`mixed_rows`) when they hold the decode slots (bound here), else the every-slot one;
        returns it and the slots its decode rows run, or None."""
        t = min((t for t in self.token_buckets if t >= tokens), default=None)
        if t is None or chunks > self.max_rows:
            return None
        every, *bound = mixed_rows(self.max_rows, t)
        rows = self.bind_rows(decode_slots, owners, bound) if bound else None
        if rows is not None:
            return self.mixed[(len(rows), t, mode)], rows
        return self.mixed[(every, t, mode)], list(range(every))
