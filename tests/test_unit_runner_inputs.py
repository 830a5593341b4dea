"""Model-free unit tier: what the runner builds on the host before a launch (tests/conftest.py, tier `unit`):
the prompt chunks' layout (`prompt_batch`), which slots a row graph runs (`graph_rows`), the graphs' buckets
and CPU staging. Exact values throughout."""

from __future__ import annotations

import torch

from ouro_backend.config import KVLayout
from ouro_backend.engine.cuda_graphs import (
    FEW_ROWS,
    FEW_ROWS_TOKENS,
    graph_rows,
    mixed_rows,
    row_buckets,
    token_buckets,
)
from ouro_backend.engine.kv_cache import KVCache
from ouro_backend.engine.prompt_batch import prompt_batch
from ouro_backend.engine.scheduler import PrefillChunk
from ouro_backend.engine.sequence import Sequence, StopChecker
from ouro_backend.engine.staging import Staging
from ouro_backend.sampling_params import SamplingParams

BS, T, MAX_BLOCKS = 4, 4, 3


def kv() -> KVCache:
    return KVCache(1, 64, BS, 1, 2, T, KVLayout.LAST_EXITED, torch.float32, torch.device("cpu"))


def seq(slot, prompt, tables, output=(), depths=()) -> Sequence:
    s = Sequence(f"r{slot}", list(prompt), SamplingParams(), 0, StopChecker([]))
    s.slot, s.block_tables = slot, tables
    s.output_ids, s.exit_depths = list(output), list(depths)
    return s


def test_prompt_batch_lays_chunks_out_after_the_decode_rows():
    a = seq(0, range(100, 106), [[1, 2], [3, 4], [5, 6], [7, 8]])
    b = seq(3, range(200, 203), [[9], [10], [11], [12]])
    chunks = [PrefillChunk(a, 4, 2, loop=2), PrefillChunk(b, 0, 3, loop=1)]
    batch = prompt_batch(chunks, kv(), decode_rows=2, max_blocks=MAX_BLOCKS)
    assert batch.positions == [4, 5, 0, 1, 2]
    # a at loop 2 writes plane 1 (blocks 3, 4): positions 4, 5 are block 4's offsets 0, 1.
    assert batch.kv_slots == [16, 17, 36, 37, 38]  # b at loop 1: plane 0, block 9
    assert batch.cu == [0, 1, 2, 4, 7] and batch.lens == [6, 3] and batch.first_row == [0, 2]
    assert batch.tables == [3, 4, 0, 9, 0, 0]
    assert batch.loop1_ids == [200, 201, 202]  # only chunks entering loop 1 are embedded
    assert batch.fill_src == batch.fill_dst == []
    assert (batch.num_tokens, batch.max_chunk) == (5, 3)


def test_prompt_batch_recomputed_positions_write_to_their_depth_and_fill_deeper_planes():
    """A request readmitted after a recompute prefills prompt + all but its last token; a generated
    token's input position ran to the depth that produced the next token."""
    # prompt 3 tokens, outputs [50, 51, 52] at depths [4, 2, 3]: positions 3, 4 ran to depths 2 and 3.
    s = seq(1, [7, 8, 9], [[1, 2], [3, 4], [5, 6], [7, 8]], output=[50, 51, 52], depths=[4, 2, 3])
    k = kv()
    at = {loop: prompt_batch([PrefillChunk(s, 0, 5, loop=loop)], k, 0, MAX_BLOCKS) for loop in (1, 2, 3, 4)}
    plane = lambda p, pos: k.kv_slot(s.block_tables[p], pos)  # noqa: E731
    assert at[1].kv_slots == [plane(0, p) for p in range(5)] and at[1].fill_src == []
    assert at[1].loop1_ids == [7, 8, 9, 50, 51]
    # Loop 2: position 3 exits here (depth 2): it fills planes 2, 3 from plane 1.
    assert at[2].kv_slots == [plane(1, p) for p in range(5)]
    assert at[2].fill_src == [plane(1, 3)] * 2 and at[2].fill_dst == [plane(2, 3), plane(3, 3)]
    # Loop 3: position 3 writes nothing (-1); position 4 exits here and fills plane 3.
    assert at[3].kv_slots == [plane(2, 0), plane(2, 1), plane(2, 2), -1, plane(2, 4)]
    assert at[3].fill_src == [plane(2, 4)] and at[3].fill_dst == [plane(3, 4)]
    assert at[4].kv_slots == [plane(3, 0), plane(3, 1), plane(3, 2), -1, -1] and at[4].fill_src == []


def test_graph_rows_run_the_decode_rows_not_a_slot_range():
    """A row graph of b rows runs the plan's decode slots padded with free ones, so a drained run's last
    requests pay for their own rows, not for every slot below the highest they hold; with too few free
    slots it falls back to a slot range that covers every row."""
    busy = object()

    def owners(*held):
        return [busy if s in held else None for s in range(8)]

    sizes = [1, 2, 4, 8]
    assert graph_rows([6], owners(6), sizes) == [6]
    assert graph_rows([7, 2, 5], owners(7, 2, 5), sizes) == [7, 2, 5, 0]  # padded with the lowest free slot
    # Slots 0-4 held by requests between prompt chunks: no free slot to pad rows 5-7 to the one graph
    # there is, of 8 rows; they run as the range 0-7 (the held slots' rows are idle, so masked).
    assert graph_rows([5, 6, 7], owners(0, 1, 2, 3, 4, 5, 6, 7), [2, 8]) == list(range(8))
    assert graph_rows([0, 1, 2], owners(0, 1, 2), [1, 2]) is None  # no graph that large: eager
    assert graph_rows([0], owners(0), []) is None  # no graphs at all
    # A mixed round with no decode rows: free slots only, else the lowest range.
    assert graph_rows([], owners(0, 2), [4]) == [1, 3, 4, 5]
    assert graph_rows([], owners(*range(8)), [4]) == [0, 1, 2, 3]


def test_mixed_graph_rows():
    """Mixed graphs of small prompt-token buckets are also captured beside FEW_ROWS bound rows."""
    assert FEW_ROWS == 16 and FEW_ROWS_TOKENS == 512
    assert mixed_rows(64, 16) == [64, 16]
    assert mixed_rows(64, 512) == [64, 16]
    assert mixed_rows(64, 640) == [64]
    assert mixed_rows(16, 128) == [16]  # no more slots than that: one graph
    assert mixed_rows(8, 128) == [8]


def test_graph_buckets():
    assert row_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert row_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert token_buckets(1024) == [16, 32, 64, 128, 256, 320, 384, 448, 512, 640, 768, 896, 1024]
    assert token_buckets(8) == []


def test_cpu_staging_is_plain_tensors():
    st = Staging(torch.device("cpu"))
    st.next_launch()
    t = st.to_device([1.5, 2.0], torch.float64)
    assert t.dtype == torch.float64 and t.tolist() == [1.5, 2.0]
    rec = torch.ones(2, 4, 3)
    host, ready = st.readback(rec)
    assert host is rec and ready is None
