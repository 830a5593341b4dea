"""Model-free unit tier: `PrefixCache` alone (keys, match, acquire, insert, release, evict, clear, hit rate).

Blocks here are plain ids from a small `BlockAllocator`; an entry holds one block per plane (4 here). Exact
ids, refcounts and free counts are asserted, as a safety net for refactors (tests/conftest.py, tier `unit`).
"""
from __future__ import annotations

import hashlib
from array import array

import pytest

from ouro_backend.engine.kv_cache import BlockAllocator
from ouro_backend.engine.prefix_cache import PrefixCache

BS = 4


def make(num_blocks=32):
    alloc = BlockAllocator(num_blocks)
    return alloc, PrefixCache(alloc, BS)


def entry_blocks(alloc, n=4) -> tuple[int, ...]:
    return tuple(alloc.allocate(n))


# --------------------------------------------------------------------------------------------------- keys


def test_keys_are_sha256_chained_over_full_blocks():
    _, pc = make()
    tokens = list(range(10, 20))  # 10 tokens: 2 full blocks, the last 2 tokens have no key
    keys = pc.keys(tokens)
    assert len(keys) == 2
    k0 = hashlib.sha256(b"" + array("q", tokens[0:4]).tobytes()).digest()
    k1 = hashlib.sha256(k0 + array("q", tokens[4:8]).tobytes()).digest()
    assert keys == [k0, k1]
    assert all(len(k) == 32 for k in keys)
    assert pc.keys(tokens[:3]) == [] and pc.keys([]) == []
    assert pc.keys(tokens[:8]) == keys  # the partial tail never contributes


def test_keys_depend_on_the_whole_prefix():
    _, pc = make()
    base = pc.keys(list(range(12)))
    same = pc.keys(list(range(12)) + [99, 98])
    assert same[:3] == base
    early = list(range(12))
    early[1] = 77  # a different first block changes every later key
    changed = pc.keys(early)
    assert all(a != b for a, b in zip(changed, base))
    late = list(range(12))
    late[9] = 77  # a change in block 2 leaves blocks 0-1 alone
    changed = pc.keys(late)
    assert changed[:2] == base[:2] and changed[2] != base[2]
    # The same block content after a different prefix gets a different key (chaining).
    assert pc.keys([0, 1, 2, 3, 4, 5, 6, 7])[1] != pc.keys([9, 9, 9, 9, 4, 5, 6, 7])[1]
    # 64-bit tokens: large ids are distinct, not truncated.
    assert pc.keys([2**40, 0, 0, 0]) != pc.keys([0, 0, 0, 0])


# ------------------------------------------------------------------------------------- insert / match


def test_insert_match_and_acquire_return_the_exact_blocks():
    alloc, pc = make()
    keys = pc.keys(list(range(12)))  # 3 keys
    b0, b1 = entry_blocks(alloc), entry_blocks(alloc)
    assert (b0, b1) == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert pc.insert(keys[0], b0) is True
    assert pc.insert(keys[1], b1) is True
    assert pc.entries[keys[0]].refs == 1 and pc.entries[keys[1]].refs == 1  # the inserting request holds them
    assert pc.num_evictable == 0
    assert pc.match(keys) == keys[:2]
    assert pc.match(keys[:1]) == keys[:1]
    assert pc.match([]) == []
    assert pc.match(keys[2:]) == []
    assert pc.acquire(keys[:2]) == [b0, b1]
    assert pc.entries[keys[0]].refs == 2 and pc.entries[keys[1]].refs == 2


def test_match_stops_at_the_first_missing_key():
    alloc, pc = make()
    keys = pc.keys(list(range(12)))
    pc.insert(keys[0], entry_blocks(alloc))
    pc.insert(keys[2], entry_blocks(alloc))  # a hole at 1
    assert pc.match(keys) == keys[:1]
    assert pc.match(keys[1:]) == []


def test_insert_refuses_a_taken_key_and_keeps_the_first_blocks():
    alloc, pc = make()
    key = pc.keys([1, 2, 3, 4])[0]
    first, second = entry_blocks(alloc), entry_blocks(alloc)
    assert pc.insert(key, first) is True
    assert pc.insert(key, second) is False
    assert pc.entries[key].blocks == first and pc.entries[key].refs == 1


# --------------------------------------------------------------------------- refcounts, release, evict


def test_release_to_zero_makes_an_entry_idle_and_evictable():
    alloc, pc = make(16)
    key = pc.keys([1, 2, 3, 4])[0]
    pc.insert(key, entry_blocks(alloc))
    pc.acquire([key])
    assert pc.entries[key].refs == 2
    pc.release([key])
    assert pc.entries[key].refs == 1 and pc.num_evictable == 0 and pc.idle_blocks([key]) == 0
    pc.release([key])
    assert pc.entries[key].refs == 0 and pc.num_evictable == 4 and pc.idle_blocks([key]) == 4
    # Acquiring an idle entry takes it out of the evictable count.
    assert pc.acquire([key]) == [(0, 1, 2, 3)]
    assert pc.entries[key].refs == 1 and pc.num_evictable == 0


def test_held_entries_are_never_evicted():
    alloc, pc = make(8)
    key = pc.keys([1, 2, 3, 4])[0]
    pc.insert(key, entry_blocks(alloc))
    alloc.allocate(4)  # the pool is now empty
    pc.evict(4)
    assert key in pc.entries and alloc.num_free == 0
    pc.clear()
    assert key in pc.entries and alloc.num_free == 0


def test_evict_frees_least_recently_released_first_and_only_what_is_needed():
    alloc, pc = make(12)
    keys = pc.keys(list(range(12)))  # 3 entries x 4 blocks fill the pool
    blocks = [entry_blocks(alloc) for _ in keys]
    assert blocks == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11)]
    for k, b in zip(keys, blocks):
        pc.insert(k, b)
    pc.release([keys[1]])
    pc.release([keys[0]])
    pc.release([keys[2]])  # idle order: 1, 0, 2
    assert alloc.num_free == 0 and pc.num_evictable == 12
    pc.evict(3)  # one entry frees 4 >= 3
    assert set(pc.entries) == {keys[0], keys[2]}
    assert alloc.num_free == 4 and pc.num_evictable == 8
    assert alloc.allocate(4) == [4, 5, 6, 7]
    pc.evict(0)  # already enough free: nothing goes
    assert len(pc.entries) == 2
    pc.evict(5)  # 0 free: entries 0 then 2 go (4, then 8 >= 5)
    assert pc.entries == {} and alloc.num_free == 8 and pc.num_evictable == 0
    assert alloc.allocate(8) == [0, 1, 2, 3, 8, 9, 10, 11]


def test_acquire_refreshes_recency():
    """An idle entry acquired and released again becomes the most recently used."""
    alloc, pc = make(8)
    keys = pc.keys(list(range(8)))
    for k in keys:
        pc.insert(k, entry_blocks(alloc))
    pc.release(keys)  # idle order: 0, 1
    pc.acquire([keys[0]])
    pc.release([keys[0]])  # idle order: 1, 0
    pc.evict(1)
    assert list(pc.entries) == [keys[0]]
    assert alloc.allocate(4) == [4, 5, 6, 7]


def test_evict_stops_when_nothing_is_idle():
    alloc, pc = make(8)
    keys = pc.keys(list(range(8)))
    for k in keys:
        pc.insert(k, entry_blocks(alloc))
    pc.release(keys[:1])
    pc.evict(8)  # wants the whole pool; only one entry is idle
    assert list(pc.entries) == [keys[1]] and alloc.num_free == 4


def test_clear_frees_every_idle_entry():
    alloc, pc = make(16)
    keys = pc.keys(list(range(12)))
    for k in keys:
        pc.insert(k, entry_blocks(alloc))
    pc.release([keys[0], keys[2]])
    assert alloc.num_free == 4
    pc.clear()
    assert list(pc.entries) == [keys[1]] and pc.entries[keys[1]].refs == 1
    assert alloc.num_free == 12 and pc.num_evictable == 0


# ---------------------------------------------------------------------------------------------- hit rate


def test_hit_rate():
    _, pc = make()
    assert pc.hit_rate is None
    pc.record(10, 0)
    assert pc.hit_rate == 0.0
    pc.record(10, 8)
    assert (pc.queried_tokens, pc.hit_tokens) == (20, 8)
    assert pc.hit_rate == pytest.approx(0.4)
