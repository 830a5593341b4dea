"""Model-free unit tier: `BlockPool` alone: the free list, and prefix caching (keys, match, acquire, insert,
release, eviction, clear, hit rate).

Blocks here are plain ids; an entry holds one block per plane (4 here). Exact ids, refcounts and free
counts are asserted, as a safety net for refactors (tests/conftest.py, tier `unit`).
"""

from __future__ import annotations

import hashlib
from array import array

import pytest

from ouro_backend.engine.block_pool import BlockPool

BS = 4


def make(num_blocks=32, caching=True) -> BlockPool:
    return BlockPool(num_blocks, BS, enable_prefix_caching=caching)


def entry_blocks(pool, n=4) -> tuple[int, ...]:
    return tuple(pool.take(n))


def cached(pool, keys) -> list:
    return [k for k in keys if pool.is_cached(k)]


# ---------------------------------------------------------------------------------------------- free list


def test_take_hands_out_ids_in_order():
    pool = make(8)
    assert (pool.num_blocks, pool.num_free, pool.num_available) == (8, 8, 8)
    assert pool.take(3) == [0, 1, 2]
    assert pool.take(0) == []
    assert pool.take(2) == [3, 4]
    assert pool.num_free == 3 and pool.usage == pytest.approx(5 / 8)


def test_freed_blocks_go_to_the_back_of_the_queue():
    """Freed blocks are reused only after the never-used ones, in the order they were freed (FIFO)."""
    pool = make(6)
    assert pool.take(4) == [0, 1, 2, 3]
    pool.free([2, 0])
    assert pool.num_free == 4
    assert pool.take(3) == [4, 5, 2]
    pool.free([3])
    assert pool.take(2) == [0, 3]
    assert pool.num_free == 0


def test_take_refuses_more_than_is_available_and_takes_nothing():
    pool = make(4)
    pool.take(1)
    with pytest.raises(RuntimeError, match=r"asked for 4 blocks, 3 available"):
        pool.take(4)
    assert pool.num_free == 3
    assert pool.take(3) == [1, 2, 3]
    with pytest.raises(RuntimeError, match=r"asked for 1 blocks, 0 available"):
        pool.take(1)


def test_a_short_take_evicts_nothing():
    pool = make(8)
    key = pool.keys([1, 2, 3, 4])[0]
    pool.insert(key, entry_blocks(pool))
    pool.release([key])  # idle: 4 blocks available besides the 4 free
    with pytest.raises(RuntimeError, match="asked for 9 blocks, 8 available"):
        pool.take(9)
    assert pool.is_cached(key) and pool.num_free == 4 and pool.num_idle_blocks == 4


# --------------------------------------------------------------------------------------------------- keys


def test_keys_are_sha256_chained_over_full_blocks():
    pool = make()
    tokens = list(range(10, 20))  # 10 tokens: 2 full blocks, the last 2 tokens have no key
    keys = pool.keys(tokens)
    assert len(keys) == 2
    k0 = hashlib.sha256(b"" + array("q", tokens[0:4]).tobytes()).digest()
    k1 = hashlib.sha256(k0 + array("q", tokens[4:8]).tobytes()).digest()
    assert keys == [k0, k1]
    assert all(len(k) == 32 for k in keys)
    assert pool.keys(tokens[:3]) == [] and pool.keys([]) == []
    assert pool.keys(tokens[:8]) == keys  # the partial tail never contributes


def test_keys_depend_on_the_whole_prefix():
    pool = make()
    base = pool.keys(list(range(12)))
    same = pool.keys(list(range(12)) + [99, 98])
    assert same[:3] == base
    early = list(range(12))
    early[1] = 77  # a different first block changes every later key
    changed = pool.keys(early)
    assert all(a != b for a, b in zip(changed, base))
    late = list(range(12))
    late[9] = 77  # a change in block 2 leaves blocks 0-1 alone
    changed = pool.keys(late)
    assert changed[:2] == base[:2] and changed[2] != base[2]
    # The same block content after a different prefix gets a different key (chaining).
    assert pool.keys([0, 1, 2, 3, 4, 5, 6, 7])[1] != pool.keys([9, 9, 9, 9, 4, 5, 6, 7])[1]
    # 64-bit tokens: large ids are distinct, not truncated.
    assert pool.keys([2**40, 0, 0, 0]) != pool.keys([0, 0, 0, 0])


# ------------------------------------------------------------------------------------- insert / match


def test_insert_match_and_acquire_return_the_exact_blocks():
    pool = make()
    keys = pool.keys(list(range(12)))  # 3 keys
    b0, b1 = entry_blocks(pool), entry_blocks(pool)
    assert (b0, b1) == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert pool.insert(keys[0], b0) is True
    assert pool.insert(keys[1], b1) is True
    assert pool.refs(keys[0]) == 1 and pool.refs(keys[1]) == 1  # the inserting request holds them
    assert pool.num_idle_blocks == 0 and pool.num_cached_blocks == 8 and pool.num_entries == 2
    assert pool.match(keys) == keys[:2]
    assert pool.match(keys[:1]) == keys[:1]
    assert pool.match([]) == []
    assert pool.match(keys[2:]) == []
    assert pool.acquire(keys[:2]) == [b0, b1]
    assert pool.refs(keys[0]) == 2 and pool.refs(keys[1]) == 2
    assert pool.acquire([]) == [] and pool.idle_blocks([]) == 0


def test_match_stops_at_the_first_missing_key():
    pool = make()
    keys = pool.keys(list(range(12)))
    pool.insert(keys[0], entry_blocks(pool))
    pool.insert(keys[2], entry_blocks(pool))  # a hole at 1
    assert pool.match(keys) == keys[:1]
    assert pool.match(keys[1:]) == []


def test_insert_refuses_a_taken_key_and_keeps_the_first_blocks():
    pool = make()
    key = pool.keys([1, 2, 3, 4])[0]
    first, second = entry_blocks(pool), entry_blocks(pool)
    assert pool.insert(key, first) is True
    assert pool.insert(key, second) is False
    assert pool.acquire([key]) == [first] and pool.refs(key) == 2


def test_with_caching_off_nothing_is_cached():
    pool = make(caching=False)
    key = pool.keys([1, 2, 3, 4])[0]
    with pytest.raises(RuntimeError, match="prefix caching is off"):
        pool.insert(key, (0, 1, 2, 3))
    assert pool.match([key]) == [] and pool.num_entries == 0
    pool.release([])  # a request without cached keys releases nothing
    pool.clear_cache()
    assert pool.num_free == 32


# --------------------------------------------------------------------------- refcounts, release, evict


def test_release_to_zero_makes_an_entry_idle_and_available():
    pool = make(16)
    key = pool.keys([1, 2, 3, 4])[0]
    pool.insert(key, entry_blocks(pool))
    pool.acquire([key])
    assert pool.refs(key) == 2
    pool.release([key])
    assert pool.refs(key) == 1 and pool.num_idle_blocks == 0 and pool.idle_blocks([key]) == 0
    assert pool.num_available == 12
    pool.release([key])
    assert pool.refs(key) == 0 and pool.num_idle_blocks == 4 and pool.idle_blocks([key]) == 4
    assert (pool.num_free, pool.num_available, pool.usage) == (12, 16, 0.0)
    # Acquiring an idle entry takes it out of the available count.
    assert pool.acquire([key]) == [(0, 1, 2, 3)]
    assert pool.refs(key) == 1 and pool.num_idle_blocks == 0 and pool.num_available == 12


def test_a_double_release_raises_and_changes_nothing():
    pool = make(16)
    keys = pool.keys(list(range(8)))
    for k in keys:
        pool.insert(k, entry_blocks(pool))
    pool.release(keys[:1])
    with pytest.raises(RuntimeError, match="no request holds"):
        pool.release(keys)  # keys[0] is idle already: neither key changes
    assert (pool.refs(keys[0]), pool.refs(keys[1]), pool.num_idle_blocks) == (0, 1, 4)
    with pytest.raises(RuntimeError, match="is not cached"):
        pool.release([pool.keys([9, 9, 9, 9])[0]])


def test_held_entries_are_never_evicted():
    pool = make(8)
    key = pool.keys([1, 2, 3, 4])[0]
    pool.insert(key, entry_blocks(pool))
    pool.take(4)  # the free list is now empty
    with pytest.raises(RuntimeError):
        pool.take(4)
    pool.clear_cache()
    assert pool.is_cached(key) and pool.num_free == 0


def test_take_evicts_least_recently_released_first_and_only_what_is_needed():
    pool = make(12)
    keys = pool.keys(list(range(12)))  # 3 entries x 4 blocks fill the pool
    blocks = [entry_blocks(pool) for _ in keys]
    assert blocks == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11)]
    for k, b in zip(keys, blocks):
        pool.insert(k, b)
    pool.release([keys[1]])
    pool.release([keys[0]])
    pool.release([keys[2]])  # idle order: 1, 0, 2
    assert pool.num_free == 0 and pool.num_idle_blocks == 12 and pool.num_available == 12
    assert pool.take(3) == [4, 5, 6]  # one entry frees 4 >= 3
    assert cached(pool, keys) == [keys[0], keys[2]]
    assert pool.num_free == 1 and pool.num_idle_blocks == 8 and pool.num_cached_blocks == 8
    assert pool.take(1) == [7]  # enough free: nothing goes
    assert pool.num_entries == 2
    assert pool.take(5) == [0, 1, 2, 3, 8]  # 0 free: entries 0 then 2 go (4, then 8 >= 5)
    assert pool.num_entries == 0 and pool.num_free == 3 and pool.num_idle_blocks == 0
    assert pool.num_cached_blocks == 0


def test_acquire_refreshes_recency():
    """An idle entry acquired and released again becomes the most recently used."""
    pool = make(8)
    keys = pool.keys(list(range(8)))
    for k in keys:
        pool.insert(k, entry_blocks(pool))
    pool.release(keys)  # idle order: 0, 1
    pool.acquire([keys[0]])
    pool.release([keys[0]])  # idle order: 1, 0
    assert pool.take(1) == [4]
    assert cached(pool, keys) == [keys[0]]


def test_clear_cache_frees_every_idle_entry():
    pool = make(16)
    keys = pool.keys(list(range(12)))
    for k in keys:
        pool.insert(k, entry_blocks(pool))
    pool.release([keys[0], keys[2]])
    assert pool.num_free == 4
    pool.clear_cache()
    assert cached(pool, keys) == [keys[1]] and pool.refs(keys[1]) == 1
    assert pool.num_free == 12 and pool.num_idle_blocks == 0


# ---------------------------------------------------------------------------------------------- hit rate


def test_hit_rate():
    pool = make()
    assert pool.hit_rate is None
    pool.record(10, 0)
    assert pool.hit_rate == 0.0
    pool.record(10, 8)
    assert (pool.queried_tokens, pool.hit_tokens) == (20, 8)
    assert pool.hit_rate == pytest.approx(0.4)
