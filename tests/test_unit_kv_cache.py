"""Model-free unit tier: the paged KV cache's bookkeeping (`KVCache` over its `BlockPool`) on a tiny CPU pool.

A characterization safety net: every block id, table and count below is what the code gives today, so a
refactor that changes allocation order, layout tables or growth shows up here first (tests/conftest.py,
tier `unit`). No checkpoint, no model, no forward.
"""

from __future__ import annotations

import pytest
import torch

from ouro_backend.config import KVLayout
from ouro_backend.engine.kv_cache import KVCache

BS, T = 4, 4  # block size, loops (= planes)


def make_kv(layout=KVLayout.LAST_EXITED, num_blocks=32, prefix=False) -> KVCache:
    return KVCache(
        num_layers=2,
        num_blocks=num_blocks,
        block_size=BS,
        kv_heads=1,
        head_dim=2,
        num_loops=T,
        layout=layout,
        dtype=torch.float32,
        device=torch.device("cpu"),
        enable_prefix_caching=prefix,
    )


# ------------------------------------------------------------------------------------------------ KVCache


def test_pool_shape_and_block_bytes():
    kv = make_kv()
    # [layers, K/V, blocks, block_size, kv_heads, head_dim]
    assert tuple(kv.kv.shape) == (2, 2, 32, BS, 1, 2)
    assert kv.kv.dtype == torch.float32 and kv.kv.device.type == "cpu"
    assert kv.block_bytes == 2 * 2 * BS * 1 * 2 * 4  # one block of one plane, every layer, K and V: 128
    assert kv.num_blocks == 32 and kv.layout is KVLayout.LAST_EXITED and not kv.pool.enable_prefix_caching


@pytest.mark.parametrize("n, blocks", [(0, 0), (1, 1), (4, 1), (5, 2), (8, 2), (9, 3)])
def test_blocks_for_rounds_up(n, blocks):
    assert make_kv().blocks_for(n) == blocks


def test_decode_planes_per_layout():
    assert make_kv(KVLayout.LAST_EXITED).decode_planes() == range(0, 4)
    assert make_kv(KVLayout.SHARED).decode_planes() == range(3, 4)
    assert make_kv("shared").layout is KVLayout.SHARED  # the string works too


@pytest.mark.parametrize(
    "layout, prompt_len, horizon, needed",
    [
        (KVLayout.LAST_EXITED, 6, 6, 8),  # 2 blocks x 4 planes
        (KVLayout.LAST_EXITED, 6, 10, 12),  # every plane decodes: 3 x 4
        (KVLayout.LAST_EXITED, 6, 3, 8),  # a horizon inside the prompt: the prompt still counts
        (KVLayout.LAST_EXITED, 4, 5, 8),  # one position past a full block: a second block everywhere
        (KVLayout.SHARED, 6, 6, 8),
        (KVLayout.SHARED, 6, 10, 9),  # planes 0-2 cover the prompt (2 each), the last plane 3
        (KVLayout.SHARED, 6, 17, 11),  # 2 + 2 + 2 + 5
    ],
)
def test_blocks_needed(layout, prompt_len, horizon, needed):
    assert make_kv(layout).blocks_needed(prompt_len, horizon) == needed


def test_allocate_last_exited_tables():
    kv = make_kv(KVLayout.LAST_EXITED)
    tables = kv.allocate(prompt_len=6, horizon=10)
    assert tables == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    assert kv.pool.num_free == 20
    # A second request continues where the first stopped.
    assert kv.allocate(prompt_len=3, horizon=3) == [[12], [13], [14], [15]]
    assert kv.pool.num_free == 16


def test_allocate_shared_tables():
    kv = make_kv(KVLayout.SHARED)
    tables = kv.allocate(prompt_len=6, horizon=10)
    assert tables == [[0, 1], [2, 3], [4, 5], [6, 7, 8]]
    assert kv.pool.num_free == 23


def test_allocate_with_shared_prefix_blocks():
    """`shared`: one tuple per leading block, one id per plane; only the rest is taken from the pool."""
    kv = make_kv(KVLayout.LAST_EXITED)
    shared = ((20, 21, 22, 23),)
    tables = kv.allocate(prompt_len=6, horizon=6, shared=shared)
    assert tables == [[20, 0], [21, 1], [22, 2], [23, 3]]
    assert kv.pool.num_free == 28  # the shared ids are not taken from the free list here


def test_grow_last_exited_returns_the_new_entries():
    kv = make_kv(KVLayout.LAST_EXITED)
    tables = kv.allocate(prompt_len=6, horizon=6)
    assert tables == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert kv.growth_needed(tables, 8) == 0  # positions < 8 fit in 2 blocks
    assert kv.grow(tables, 8) == []
    assert kv.growth_needed(tables, 9) == 4
    assert kv.grow(tables, 9) == [(0, 2, 8), (1, 2, 9), (2, 2, 10), (3, 2, 11)]
    assert tables == [[0, 1, 8], [2, 3, 9], [4, 5, 10], [6, 7, 11]]
    assert kv.growth_needed(tables, 9) == 0 and kv.grow(tables, 9) == []
    # Two blocks at once per plane, plane by plane.
    assert kv.grow(tables, 20) == [
        (0, 3, 12),
        (0, 4, 13),
        (1, 3, 14),
        (1, 4, 15),
        (2, 3, 16),
        (2, 4, 17),
        (3, 3, 18),
        (3, 4, 19),
    ]
    assert kv.pool.num_free == 12
    # A horizon behind the tables never shrinks them.
    assert kv.grow(tables, 4) == [] and [len(t) for t in tables] == [5, 5, 5, 5]


def test_grow_shared_extends_only_the_last_plane():
    kv = make_kv(KVLayout.SHARED)
    tables = kv.allocate(prompt_len=6, horizon=6)
    assert tables == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert kv.growth_needed(tables, 13) == 2
    assert kv.grow(tables, 13) == [(3, 2, 8), (3, 3, 9)]
    assert tables == [[0, 1], [2, 3], [4, 5], [6, 7, 8, 9]]


def test_release_prefill_planes():
    shared = make_kv(KVLayout.SHARED)
    tables = shared.allocate(prompt_len=6, horizon=10)
    shared.release_prefill_planes(tables)
    assert tables == [[], [], [], [6, 7, 8]]
    assert shared.pool.num_free == 29
    assert shared.pool.take(29)[-6:] == [0, 1, 2, 3, 4, 5]  # freed plane by plane, at the back

    last = make_kv(KVLayout.LAST_EXITED)
    tables = last.allocate(prompt_len=6, horizon=6)
    last.release_prefill_planes(tables)  # a no-op: every plane is read by later tokens
    assert tables == [[0, 1], [2, 3], [4, 5], [6, 7]] and last.pool.num_free == 24


def test_free_and_keep():
    kv = make_kv()
    tables = kv.allocate(prompt_len=12, horizon=12)
    assert tables == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    kv.free(tables, keep=1)  # the first block of each plane belongs to a prefix-cache entry
    assert tables == [[], [], [], []]  # every table is emptied, kept blocks included
    assert kv.pool.num_free == 28
    assert kv.pool.take(28)[-8:] == [1, 2, 4, 5, 7, 8, 10, 11]  # 0, 3, 6, 9 were not freed

    kv2 = make_kv()
    tables = kv2.allocate(prompt_len=5, horizon=5)
    kv2.free(tables)
    assert tables == [[], [], [], []] and kv2.pool.num_free == 32


@pytest.mark.parametrize("pos, slot", [(0, 20), (3, 23), (4, 8), (7, 11), (8, 36), (11, 39)])
def test_kv_slot_arithmetic(pos, slot):
    # table [5, 2, 9]: position p lives in block table[p // 4] at offset p % 4.
    assert make_kv().kv_slot([5, 2, 9], pos) == slot


def test_kv_slot_past_the_table_raises():
    with pytest.raises(IndexError):
        make_kv().kv_slot([5, 2, 9], 12)


def test_usage_and_num_available_without_prefix_cache():
    kv = make_kv(num_blocks=16)
    assert (kv.pool.num_available, kv.pool.usage) == (16, 0.0)
    tables = kv.allocate(prompt_len=4, horizon=4)  # 4 blocks
    assert (kv.pool.num_available, kv.pool.usage) == (12, 0.25)
    kv.grow(tables, 5)  # 4 more
    assert (kv.pool.num_available, kv.pool.usage) == (8, 0.5)
    kv.free(tables)
    assert (kv.pool.num_available, kv.pool.usage) == (16, 0.0)


def test_idle_prefix_entries_count_as_available_and_take_evicts_them():
    kv = make_kv(num_blocks=16, prefix=True)
    tables = kv.allocate(prompt_len=4, horizon=4)
    assert tables == [[0], [1], [2], [3]]
    key = kv.pool.keys([1, 2, 3, 4])[0]
    assert kv.pool.insert(key, (0, 1, 2, 3))
    kv.free(tables, keep=1)  # the entry owns the blocks: nothing goes back to the allocator
    assert (kv.pool.num_free, kv.pool.num_available, kv.pool.usage) == (12, 12, 0.25)
    kv.pool.release([key])  # idle: still cached, but counted as available
    assert (kv.pool.num_free, kv.pool.num_available, kv.pool.usage) == (12, 16, 0.0)
    assert kv.pool.take(12) == list(range(4, 16))  # the free list suffices: nothing is evicted
    assert kv.pool.is_cached(key)
    assert kv.pool.take(2) == [0, 1]  # short: the idle entry is evicted and its blocks handed out
    assert kv.pool.num_entries == 0 and kv.pool.num_idle_blocks == 0
    assert kv.pool.num_free == 2 and kv.pool.num_available == 2


def test_take_without_prefix_cache_raises_when_short():
    kv = make_kv(num_blocks=4)
    assert kv.pool.take(3) == [0, 1, 2]
    with pytest.raises(RuntimeError, match="asked for 2 blocks, 1 available"):
        kv.pool.take(2)


def test_kv_slots_is_kv_slot_over_a_range():
    kv = make_kv()
    assert (
        kv.kv_slots([5, 2, 9], 2, 10)
        == [kv.kv_slot([5, 2, 9], p) for p in range(2, 10)]
        == [22, 23, 8, 9, 10, 11, 36, 37]
    )
    assert kv.kv_slots([5], 1, 1) == []


def test_allocate_and_grow_take_all_planes_or_nothing():
    """Short of blocks, allocate and grow raise before any plane took a block: nothing leaks."""
    kv = make_kv(num_blocks=10)
    with pytest.raises(RuntimeError, match="asked for 12 blocks, 10 available"):
        kv.allocate(prompt_len=9, horizon=9)  # 3 blocks in each of 4 planes
    assert kv.pool.num_free == 10
    tables = kv.allocate(prompt_len=4, horizon=4)  # 4 blocks
    with pytest.raises(RuntimeError, match="asked for 8 blocks, 6 available"):
        kv.grow(tables, 9)  # 2 more blocks in each of 4 decode planes
    assert tables == [[0], [1], [2], [3]] and kv.pool.num_free == 6
