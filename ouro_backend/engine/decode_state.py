"""The device-resident decode state: one row per engine slot, owned by the model runner (docs/engine.md).

A running request holds a slot from admission to its end. While it decodes, its row says everything a
round needs to advance it without the host: the token in flight, its position and current loop, the
exit hazard carried between loops, the request's loop bounds, threshold, sampling values and limits,
its hidden state between loops and its block table per plane. A decode round reads the rows, runs one
loop, decides exits on the device and writes each row's next step back (loop r+1 of the same token, or
loop 1 of the next token); a row whose request reaches max_tokens or EOS switches itself off.

The host writes a row when a request is admitted (`admit`), switches rows off when it ends a request
(`release`), and otherwise only reads the per-round records the rounds leave behind.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..sampling_params import SamplingParams

# Integer columns of `DecodeState.ints`.
ACTIVE, TOKEN, POS, LOOP, NGEN, PENDING, MIN_LOOPS, MAX_LOOPS, MAX_TOKENS, MIN_TOKENS, IGNORE_EOS, TOP_K, \
    SEED, TRACE_LEN = range(14)
NUM_INTS = 14
# Float64 columns of `DecodeState.floats` (the threshold is compared in float64, like the Python float it is).
THRESHOLD, TEMPERATURE, TOP_P = range(3)
NUM_FLOATS = 3
# Every column by name, for the fused kernels (`ouro_backend/kernels/decode_step.py`).
COLUMNS = dict(ACTIVE=ACTIVE, TOKEN=TOKEN, POS=POS, LOOP=LOOP, NGEN=NGEN, PENDING=PENDING, MIN_LOOPS=MIN_LOOPS,
               MAX_LOOPS=MAX_LOOPS, MAX_TOKENS=MAX_TOKENS, MIN_TOKENS=MIN_TOKENS, IGNORE_EOS=IGNORE_EOS, TOP_K=TOP_K,
               SEED=SEED, TRACE_LEN=TRACE_LEN, THRESHOLD=THRESHOLD, TEMPERATURE=TEMPERATURE, TOP_P=TOP_P)
# Rows of a round's record (`DecodeState.new_record`): one column per slot.
REC_EMITTED, REC_TOKEN, REC_DEPTH, REC_LOGPROB = range(4)
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
    resume: Optional[tuple[int, int]] = None


class DecodeState:
    def __init__(self, num_slots: int, num_loops: int, max_blocks: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device):
        self.num_slots, self.num_loops, self.max_blocks = num_slots, num_loops, max_blocks
        self.device = device
        self.ints = torch.zeros(num_slots, NUM_INTS, dtype=torch.int64, device=device)
        self.floats = torch.zeros(num_slots, NUM_FLOATS, dtype=torch.float64, device=device)
        self.remaining = torch.ones(num_slots, dtype=torch.float32, device=device)
        self.trace = torch.ones(num_slots, MAX_TRACE, dtype=torch.int64, device=device)
        self.tables = torch.zeros(num_slots, num_loops, max_blocks, dtype=torch.int32, device=device)
        self.hidden = torch.zeros(num_slots, hidden_size, dtype=dtype, device=device)

    def new_record(self, rounds: int = 1) -> torch.Tensor:
        """fp32 [rounds, 4, slots]: per round and slot, (emitted?, token, exit depth, logprob). Token ids
        below 2^24 are exact in fp32."""
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
        ints = [0, token, row.prompt_len - 1 + ngen, 1, ngen, 0, p.min_loops, row.max_loops, p.max_tokens,
                p.min_tokens, int(p.ignore_eos), p.top_k, seed - 2**64 if seed >= 2**63 else seed, len(trace)]
        for name, v in zip(COLUMNS, ints):  # COLUMNS names the int columns first, in order
            if not -2**63 <= v < 2**63:
                raise ValueError(f"{name} ({v}) does not fit the decode state's int64")
        floats = [float(row.threshold), float(p.temperature), float(p.top_p)]  # OverflowError past float64
        tables = []
        for plane in range(num_loops):
            t = row.block_tables[plane][:max_blocks]
            tables += t + [0] * (max_blocks - len(t))
        return ints, floats, trace + [1] * (MAX_TRACE - len(trace)), tables

    def admit(self, slots: torch.Tensor, ints: torch.Tensor, floats: torch.Tensor, traces: torch.Tensor,
              tables: torch.Tensor) -> None:
        """Write new rows (inactive until their prompt's last chunk samples the first token)."""
        n = slots.shape[0]
        self.ints.index_copy_(0, slots, ints.view(n, NUM_INTS))
        self.floats.index_copy_(0, slots, floats.view(n, NUM_FLOATS))
        self.remaining.index_fill_(0, slots, 1.0)
        self.trace.index_copy_(0, slots, traces.view(n, MAX_TRACE))
        self.tables.index_copy_(0, slots, tables.view(n, self.num_loops, self.max_blocks))

    def release(self, slots: torch.Tensor) -> None:
        self.ints[:, ACTIVE].index_fill_(0, slots, 0)

    def slots_at(self, rows: torch.Tensor, pos: torch.Tensor, block_size: int) -> torch.Tensor:
        """int64 [n, T]: the KV slot of position pos[i] in every plane of row rows[i]."""
        planes = torch.arange(self.num_loops, device=pos.device)
        blocks = self.tables[rows[:, None], planes[None, :], (pos // block_size)[:, None]]
        return blocks.long() * block_size + (pos % block_size)[:, None]

    def trace_depth(self, ints: torch.Tensor, rows: torch.Tensor) -> Optional[torch.Tensor]:
        """exit_mode=trace: the depth of each row's current token (the trace cycled over decode steps)."""
        k = (ints[:, NGEN] - 1).clamp_min(0) % ints[:, TRACE_LEN].clamp_min(1)
        return self.trace[rows].gather(1, k[:, None])[:, 0]
