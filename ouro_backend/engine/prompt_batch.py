"""A round's prompt chunks as flat host inputs for the loop (model-free: lists of ints).

In a round with prompt chunks, the loop runs D decode rows (one token each) and then every chunk's
tokens. This module lays the chunks out after the decode rows: positions, the KV slot each token writes,
cu_seqlens over all rows, sequence lengths and block tables per chunk, the token ids of chunks entering
loop 1, and for recomputed positions (a request readmitted after a recompute preemption) the LAST_EXITED
fill pairs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .kv_cache import KVCache
from .scheduler import PrefillChunk


@dataclass
class PromptBatch:
    positions: list[int] = field(default_factory=list)  # per prompt token
    kv_slots: list[int] = field(default_factory=list)  # per prompt token; -1: writes nothing
    cu: list[int] = field(default_factory=list)  # cu_seqlens over the D decode rows, then the chunks
    lens: list[int] = field(default_factory=list)  # per chunk: the KV length it attends to
    tables: list[int] = field(default_factory=list)  # per chunk: its plane's block table, max_blocks wide
    loop1_ids: list[int] = field(default_factory=list)  # token ids of the chunks at loop 1, in chunk order
    first_row: list[int] = field(default_factory=list)  # per chunk: its first token's row among prompt tokens
    # Recomputed positions whose recorded exit depth is this loop: their KV goes to the deeper planes too.
    fill_src: list[int] = field(default_factory=list)
    fill_dst: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.positions)

    @property
    def max_chunk(self) -> int:
        return max(b - a for a, b in zip(self.cu, self.cu[1:]))


def prompt_batch(chunks: list[PrefillChunk], kv: KVCache, decode_rows: int, max_blocks: int) -> PromptBatch:
    """Lay out `chunks` after `decode_rows` decode rows. A chunk at loop l reads and writes plane l - 1.

    A recomputed position (past the prompt: a generated token prefilled again) ran to a recorded depth d:
    at loops past d it writes nothing (its KV there was the copy of plane d), and at loop d its KV is
    also copied into planes d..T-1, as the exit that produced it did."""
    T = kv.num_loops
    b = PromptBatch(cu=list(range(decode_rows + 1)))
    for c in chunks:
        seq, end = c.seq, c.start + c.n
        table = seq.block_tables[c.loop - 1]
        b.first_row.append(b.cu[-1] - decode_rows)
        b.positions.extend(range(c.start, end))
        slots = kv.kv_slots(table, c.start, end)
        if end > len(seq.prompt_ids) and not c.deep:  # a deep chunk writes every position's deep KV
            for i, p in enumerate(range(c.start, end)):
                d = seq.position_depth(p, T)
                if d < c.loop:
                    slots[i] = -1
                elif d == c.loop:
                    b.fill_src += [slots[i]] * (T - d)
                    b.fill_dst += [kv.kv_slot(seq.block_tables[q], p) for q in range(d, T)]
        b.kv_slots.extend(slots)
        b.cu.append(b.cu[-1] + c.n)
        b.lens.append(end)
        t = table[: kv.blocks_for(end)]
        b.tables.extend(t + [0] * (max_blocks - len(t)))
        if c.loop == 1:
            b.loop1_ids.extend(seq.token_ids(c.start, end))
    return b
