"""The device-resident decode state and its transitions: one row per engine slot (docs/engine.md).

A running request holds a slot (a row of this state; "slot" never means a KV position here, which is a
`kv_slot`) from admission to its end. While it decodes, its row says everything a round needs to advance
it without the host: the token in flight, its position and current loop, the exit hazard carried
between loops, the request's loop bounds, threshold, sampling values and limits, its hidden state between
loops and its block table per plane. A decode round reads the rows (`decode_inputs`), runs one loop,
decides exits on the device and writes each row's next step back (`advance`: loop r+1 of the same
token, or loop 1 of the next token); a row whose request reaches max_tokens or EOS switches itself off.
Those two stop rules are decided here, once: the round's record says which rule ended a row
(`REC_EMITTED`), and the host reads that instead of deciding again.

NOTE: this class is the only writer of its tensors. The host changes rows through its methods: `admit`
(a new request), `release` (the host ended or preempted it), `activate` (a resumed prompt's last chunk),
`park` (a round's rows that wait for their deferred deep chunk),
`extend_tables` (its decode planes grew), `save_row` / `restore_row` (swap) and `restart_at_loop_one`
(after a speculative step); the rounds change them through `advance`, `emit_first` and `store_hidden`.

`fused=True` runs `decode_inputs` and `advance` as fused Triton kernels (`kernels/decode_step.py`, the
CUDA path); otherwise they run here in torch (the CPU path, and the kernels' twin: same results bit for
bit).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from ..config import ExitMode
from ..sampling_params import SamplingParams
from .exit_policy import ExitInputs, exit_rule

# Integer columns of `DecodeState.ints`.
(
    ACTIVE,
    TOKEN,
    POS,
    LOOP,
    NGEN,
    PENDING,
    MIN_LOOPS,
    MAX_LOOPS,
    MAX_TOKENS,
    MIN_TOKENS,
    IGNORE_EOS,
    TOP_K,
    SEED,
    TRACE_LEN,
) = range(14)
NUM_INTS = 14
# Float64 columns of `DecodeState.floats` (the threshold is compared in float64, like the Python float it is).
THRESHOLD, TEMPERATURE, TOP_P = range(3)
NUM_FLOATS = 3
# Every column by name, for the fused kernels (`ouro_backend/kernels/decode_step.py`).
COLUMNS = dict(
    ACTIVE=ACTIVE,
    TOKEN=TOKEN,
    POS=POS,
    LOOP=LOOP,
    NGEN=NGEN,
    PENDING=PENDING,
    MIN_LOOPS=MIN_LOOPS,
    MAX_LOOPS=MAX_LOOPS,
    MAX_TOKENS=MAX_TOKENS,
    MIN_TOKENS=MIN_TOKENS,
    IGNORE_EOS=IGNORE_EOS,
    TOP_K=TOP_K,
    SEED=SEED,
    TRACE_LEN=TRACE_LEN,
    THRESHOLD=THRESHOLD,
    TEMPERATURE=TEMPERATURE,
    TOP_P=TOP_P,
)
# Rows of a round's record (`DecodeState.new_record`): one column per slot.
REC_EMITTED, REC_TOKEN, REC_DEPTH, REC_LOGPROB = range(4)
# Values of a record's REC_EMITTED row: no token; a token; a token that ended its request on EOS ("stop");
# a token that ended it at max_tokens ("length"). EOS wins when both hold. EMIT_DEEP: no token, the row
# went idle to wait for its deep chunk (deferred deep batching, `deferred_deep.py`).
EMIT_NONE, EMIT_TOKEN, EMIT_EOS, EMIT_LENGTH, EMIT_DEEP = range(5)
MAX_TRACE = 64  # longest exit_trace a request may give (exit_mode=trace)


@dataclass
class NewRow:
    """What the host knows of a request when it is admitted."""

    slot: int
    prompt_len: int
    params: SamplingParams
    max_loops: int
    threshold: float
    seed: int  # 64-bit sampling seed (the request's own, or one the engine drew)
    block_tables: list[list[int]]  # per plane
    # Readmitted after a recompute preemption: (its last token, tokens generated). The row starts at that
    # token, which the prefill of everything before it does not sample again.
    resume: tuple[int, int] | None = None


@dataclass
class DecodeInputs:
    """One loop's inputs for decode rows `idx`, read from the state by `DecodeState.decode_inputs`."""

    pos: torch.Tensor  # int64 [S]: each row's position (0 for idle rows)
    kv_slot: torch.Tensor  # int64 [S]: where this loop's K/V goes, -1 for idle rows
    seq_lens: torch.Tensor  # int32 [S]
    tables: torch.Tensor  # int32 [S, max_blocks]: the block table of this loop's plane
    h: torch.Tensor  # [S, H]: the token's embedding at loop 1, else the hidden state left by the last loop
    kv_slots: torch.Tensor  # int64 [S, num_loops]: the KV slot of pos in every plane


@dataclass
class SavedRow:
    """Device copies of one row (a few hundred bytes), for swapping a preempted request out."""

    ints: torch.Tensor
    floats: torch.Tensor
    remaining: torch.Tensor
    trace: torch.Tensor
    hidden: torch.Tensor


def _kernels() -> ModuleType:
    from ..kernels import decode_step  # imports Triton: only on the fused path

    return decode_step


class DecodeState:
    def __init__(
        self,
        num_slots: int,
        num_loops: int,
        max_blocks: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        *,
        block_size: int,
        last_exited: bool,
        eos_ids: list[int],
        fused: bool = False,
    ):
        self.num_slots, self.num_loops, self.max_blocks = num_slots, num_loops, max_blocks
        self.device = device
        self.block_size, self.last_exited, self.fused = block_size, last_exited, fused
        self.eos = torch.tensor(sorted(eos_ids) or [-1], dtype=torch.int64, device=device)  # -1: no EOS
        self.ints = torch.zeros(num_slots, NUM_INTS, dtype=torch.int64, device=device)
        self.floats = torch.zeros(num_slots, NUM_FLOATS, dtype=torch.float64, device=device)
        self.remaining = torch.ones(num_slots, dtype=torch.float32, device=device)
        self.trace = torch.ones(num_slots, MAX_TRACE, dtype=torch.int64, device=device)
        self.tables = torch.zeros(num_slots, num_loops, max_blocks, dtype=torch.int32, device=device)
        self.hidden = torch.zeros(num_slots, hidden_size, dtype=dtype, device=device)

    def new_record(self, rounds: int = 1) -> torch.Tensor:
        """fp32 [rounds, 4, slots]: per round and slot, (REC_EMITTED value, token, exit depth, logprob). Token
        ids below 2^24 are exact in fp32."""
        return torch.zeros(rounds, 4, self.num_slots, dtype=torch.float32, device=self.device)

    @staticmethod
    def host_row(row: NewRow, num_loops: int, max_blocks: int) -> tuple[list, list, list, list]:
        """One request's flat host lists (ints, floats, trace, tables) for `admit`: exactly NUM_INTS int64
        values, NUM_FLOATS float64s, MAX_TRACE depths and num_loops x max_blocks block ids. A value that
        does not fit raises ValueError naming it, here, for this request alone (add_request refuses such
        requests first: `SamplingParams.validate` with the engine's limits)."""
        p = row.params
        seed = row.seed & (2**64 - 1)
        trace = list(p.exit_trace or [row.max_loops])
        if len(trace) > MAX_TRACE:
            raise ValueError(f"exit_trace has {len(trace)} depths; at most {MAX_TRACE} are supported")
        # POS is the last prompt token's: sampling the first token moves the row to prompt_len.
        token, ngen = row.resume or (0, 0)
        ints = [
            0,
            token,
            row.prompt_len - 1 + ngen,
            1,
            ngen,
            0,
            p.min_loops,
            row.max_loops,
            p.max_tokens,
            p.min_tokens,
            int(p.ignore_eos),
            p.top_k,
            seed - 2**64 if seed >= 2**63 else seed,
            len(trace),
        ]
        for name, v in zip(COLUMNS, ints):  # COLUMNS names the int columns first, in order
            if not -(2**63) <= v < 2**63:
                raise ValueError(f"{name} ({v}) does not fit the decode state's int64")
        floats = [float(row.threshold), float(p.temperature), float(p.top_p)]  # OverflowError past float64
        tables = []
        for plane in range(num_loops):
            t = row.block_tables[plane][:max_blocks]
            tables += t + [0] * (max_blocks - len(t))
        return ints, floats, trace + [1] * (MAX_TRACE - len(trace)), tables

    # ---- host writes (between launches, in stream order) ----
    def admit(
        self, slots: torch.Tensor, ints: torch.Tensor, floats: torch.Tensor, traces: torch.Tensor, tables: torch.Tensor
    ) -> None:
        """Write new rows (inactive until their prompt's last chunk samples the first token)."""
        n = slots.shape[0]
        self.ints.index_copy_(0, slots, ints.view(n, NUM_INTS))
        self.floats.index_copy_(0, slots, floats.view(n, NUM_FLOATS))
        self.remaining.index_fill_(0, slots, 1.0)
        self.trace.index_copy_(0, slots, traces.view(n, MAX_TRACE))
        self.tables.index_copy_(0, slots, tables.view(n, self.num_loops, self.max_blocks))

    def release(self, slots: torch.Tensor) -> None:
        """Switch rows off (their requests ended or were preempted); the rest of each row stays."""
        self.ints[:, ACTIVE].index_fill_(0, slots, 0)

    def activate(self, slots: torch.Tensor) -> None:
        """Switch on rows that already hold their next token (a recompute's prefill has just finished)."""
        self.ints[:, ACTIVE].index_fill_(0, slots, 1)

    def park(self, idx: torch.Tensor, wait: torch.Tensor) -> None:
        """Switch off the rows of `idx` where `wait` (bool) holds, keeping the rest of each row: they resume
        when their deep chunk emits their token (`emit_first`). Graph-safe (no host values)."""
        active = self.ints[:, ACTIVE].index_select(0, idx)
        self.ints[:, ACTIVE].index_copy_(0, idx, torch.where(wait, 0, active))

    def extend_tables(
        self, slots: torch.Tensor, planes: torch.Tensor, index: torch.Tensor, blocks: torch.Tensor
    ) -> None:
        """tables[slots[i], planes[i], index[i]] = blocks[i]: a request's decode planes grew."""
        self.tables.index_put_((slots, planes, index), blocks)

    def save_row(self, slot: int) -> SavedRow:
        return SavedRow(
            self.ints[slot].clone(),
            self.floats[slot].clone(),
            self.remaining[slot].clone(),
            self.trace[slot].clone(),
            self.hidden[slot].clone(),
        )

    def restore_row(self, slot: int, row: SavedRow, tables: torch.Tensor) -> None:
        """Write a saved row back at `slot` with new block tables (int32 [num_loops, max_blocks])."""
        self.ints[slot] = row.ints
        self.floats[slot] = row.floats
        self.remaining[slot] = row.remaining
        self.trace[slot] = row.trace
        self.hidden[slot] = row.hidden
        self.tables[slot] = tables

    # ---- reads ----
    def kv_slots_at(self, rows: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """int64 [n, num_loops]: the KV slot of position pos[i] in every plane of row rows[i]."""
        bs = self.block_size
        planes = torch.arange(self.num_loops, device=pos.device)
        blocks = self.tables[rows[:, None], planes[None, :], (pos // bs)[:, None]]
        return blocks.long() * bs + (pos % bs)[:, None]

    def trace_depth(self, ints: torch.Tensor, rows: torch.Tensor) -> torch.Tensor | None:
        """exit_mode=trace: the depth of each row's current token (the trace cycled over decode steps)."""
        k = (ints[:, NGEN] - 1).clamp_min(0) % ints[:, TRACE_LEN].clamp_min(1)
        return self.trace[rows].gather(1, k[:, None])[:, 0]

    def sampling_rows(self, idx: torch.Tensor, offset: torch.Tensor | int = 0) -> tuple[torch.Tensor, ...]:
        """The sampler's per-row arguments of slots `idx`: temperature, top-k, top-p, seed, and the noise
        counter = tokens the request generated so far + `offset` (model/sampler.py)."""
        ints, floats = self.ints.index_select(0, idx), self.floats.index_select(0, idx)
        return floats[:, TEMPERATURE], ints[:, TOP_K], floats[:, TOP_P], ints[:, SEED], ints[:, NGEN] + offset

    # ---- the rounds (eager, or inside a CUDA graph) ----
    def decode_inputs(self, idx: torch.Tensor, embed: torch.Tensor) -> DecodeInputs:
        """The loop's inputs for decode rows `idx` (slots)."""
        if self.fused:
            return DecodeInputs(*_kernels().prepare(self, idx, embed, self.block_size, self.last_exited, COLUMNS))
        T = self.num_loops
        ints = self.ints.index_select(0, idx)
        active = ints[:, ACTIVE] > 0
        pos = torch.where(active, ints[:, POS], 0)
        loop = ints[:, LOOP]
        kv_slots = self.kv_slots_at(idx, pos)
        plane = (loop - 1).clamp(0, T - 1) if self.last_exited else torch.full_like(loop, T - 1)
        kv_slot = torch.where(active, kv_slots.gather(1, plane[:, None])[:, 0], -1)
        h = torch.where((loop == 1)[:, None], embed[ints[:, TOKEN]], self.hidden.index_select(0, idx))
        return DecodeInputs(pos, kv_slot, torch.where(active, pos + 1, 1).int(), self.tables[idx, plane], h, kv_slots)

    def advance(
        self,
        idx: torch.Tensor,
        lam: torch.Tensor | None,
        tok: torch.Tensor,
        lp: torch.Tensor,
        kv_slots: torch.Tensor,
        rec: torch.Tensor,
        mode: ExitMode,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """After loop r and the coda of decode rows `idx`: exits, next steps and the record `rec` [4, slots];
        returns the LAST_EXITED fill's (src, dst) KV slots [S, num_loops] (-1: nothing to copy)."""
        if self.fused:
            return _kernels().advance(self, idx, lam, tok, lp, kv_slots, self.eos, rec, mode, self.last_exited, COLUMNS)
        T = self.num_loops
        ints = self.ints.index_select(0, idx)
        active = ints[:, ACTIVE] > 0
        loop = ints[:, LOOP]
        x = ExitInputs(
            loop,
            self.remaining.index_select(0, idx),
            ints[:, PENDING] > 0,
            ints[:, MIN_LOOPS],
            ints[:, MAX_LOOPS],
            self.floats.index_select(0, idx)[:, THRESHOLD],
            self.trace_depth(ints, idx) if mode is ExitMode.TRACE else None,
        )
        exit_now, remaining, pending = exit_rule(mode, x, lam)
        exit_now = exit_now & active
        # An idle row keeps its state: a graph's masked rows include rows waiting to resume after a recompute.
        remaining = torch.where(active, remaining, x.remaining)
        pending = torch.where(active, pending, x.pending)
        self.emit(idx, ints, active, exit_now, tok, lp, loop, remaining, pending, rec)
        # The exit plane's KV of this position goes into the deeper planes (LAST_EXITED).
        fill = exit_now[:, None] & (torch.arange(T, device=idx.device)[None, :] >= loop[:, None]) & self.last_exited
        src = kv_slots.gather(1, (loop - 1).clamp(0, T - 1)[:, None]).expand(-1, T)
        return torch.where(fill, src, -1), torch.where(fill, kv_slots, -1)

    def emit(
        self,
        idx: torch.Tensor,
        ints: torch.Tensor,
        active: torch.Tensor,
        emit: torch.Tensor,
        tok: torch.Tensor,
        lp: torch.Tensor,
        depth: torch.Tensor,
        remaining: torch.Tensor,
        pending: torch.Tensor,
        rec: torch.Tensor,
    ) -> None:
        """Record the emitting rows' tokens and write every row's next step: loop r+1 of the same token, or
        loop 1 of the next one; a request that reaches max_tokens or EOS goes idle, and its record says
        which (EMIT_EOS, EMIT_LENGTH). `ints` are the rows' values before this step."""
        ngen = ints[:, NGEN] + emit.long()
        is_eos = (tok[:, None] == self.eos[None, :]).any(-1)
        eos_stop = is_eos & (ints[:, IGNORE_EOS] == 0) & (ngen >= ints[:, MIN_TOKENS])
        length_stop = ngen >= ints[:, MAX_TOKENS]
        changed = {
            ACTIVE: (active & ~(emit & (eos_stop | length_stop))).long(),
            TOKEN: torch.where(emit, tok, ints[:, TOKEN]),
            POS: ints[:, POS] + emit.long(),
            NGEN: ngen,
            LOOP: torch.where(emit, 1, ints[:, LOOP] + active.long()),
            PENDING: (pending & ~emit).long(),
        }
        # One write of whole rows (a stack of column views) instead of a clone and a write per column.
        self.ints.index_copy_(0, idx, torch.stack([changed.get(c, ints[:, c]) for c in range(NUM_INTS)], dim=1))
        self.remaining.index_copy_(0, idx, torch.where(emit, 1.0, remaining))
        code = torch.where(eos_stop, EMIT_EOS, torch.where(length_stop, EMIT_LENGTH, EMIT_TOKEN)) * emit.long()
        rec.index_copy_(1, idx, torch.stack([code.float(), tok.float(), depth.float(), lp.float()]))

    def emit_first(self, idx: torch.Tensor, tok: torch.Tensor, lp: torch.Tensor, rec: torch.Tensor) -> None:
        """Rows whose prompt finished this round emit their first token (at full depth) and start decoding;
        so do rows whose deferred deep chunk finished (their boundary token)."""
        n = idx.shape[0]
        yes = torch.ones(n, dtype=torch.bool, device=idx.device)
        depth = torch.full((n,), self.num_loops, dtype=torch.long, device=idx.device)
        self.emit(
            idx, self.ints.index_select(0, idx), yes, yes, tok, lp, depth, torch.ones(n, device=idx.device), ~yes, rec
        )

    def store_hidden(self, idx: torch.Tensor, h: torch.Tensor) -> None:
        """Keep the decode rows' loop output for their next loop."""
        self.hidden.index_copy_(0, idx, h)

    def restart_at_loop_one(self, idx: torch.Tensor) -> None:
        """After a speculative step: every row waits at loop 1 of its next token."""
        self.ints[:, LOOP].index_fill_(0, idx, 1)
