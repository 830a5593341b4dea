"""Prompt blocks shared between requests by content (docs/kv-memory.md, "Prefix caching").

A full prompt block is identified by the SHA-256 of its tokens chained with the key of the blocks before
it, so equal keys mean equal prefixes. (A cryptographic hash, because a key collision would hand one
request another's KV: a client able to craft colliding prompts could read what others' prompts make the
model say.) Under LAST_EXITED a prompt position runs every loop, so its KV in each
plane is a function of that prefix alone: an entry holds the block of every plane (T blocks) and any
request whose prompt starts with the same full blocks reads them instead of computing them. (SHARED keeps
only the last plane of a prompt, and a suffix's prefill needs the others, so it is not cached.)

Entries are reference-counted by the requests that hold them. At zero they stay, least recently used
first, until the allocator needs their blocks (`evict`). The cache lives with its engine, whose model,
dtype and layout are fixed, so the key is the tokens alone.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

from .kv_cache import BlockAllocator


@dataclass
class Entry:
    blocks: tuple[int, ...]  # one per plane
    refs: int = 0


class PrefixCache:
    def __init__(self, allocator: BlockAllocator, block_size: int):
        self.allocator, self.block_size = allocator, block_size
        self.entries: dict[bytes, Entry] = {}
        self._idle: OrderedDict[bytes, None] = OrderedDict()  # keys with refs == 0, least recently used first
        self.num_evictable = 0  # blocks of the idle entries (read on every admission and growth check)
        self.queried_tokens = self.hit_tokens = 0

    def keys(self, tokens: list[int]) -> list[bytes]:
        """The chained key of every full block of `tokens`."""
        keys, h, bs = [], b"", self.block_size
        for i in range(len(tokens) // bs):
            h = hashlib.sha256(h + array("q", tokens[i * bs:(i + 1) * bs]).tobytes()).digest()
            keys.append(h)
        return keys

    def match(self, keys: list[bytes]) -> list[bytes]:
        """The longest run of `keys` from the start that the cache holds."""
        n = 0
        while n < len(keys) and keys[n] in self.entries:
            n += 1
        return keys[:n]

    def idle_blocks(self, keys: list[bytes]) -> int:
        """Blocks of these entries that now count as evictable (acquiring them takes them out of that)."""
        return sum(len(self.entries[k].blocks) for k in keys if k in self._idle)

    def acquire(self, keys: list[bytes]) -> list[tuple[int, ...]]:
        """Take a reference on each entry; returns their blocks."""
        out = []
        for k in keys:
            e = self.entries[k]
            e.refs += 1
            if k in self._idle:
                del self._idle[k]
                self.num_evictable -= len(e.blocks)
            out.append(e.blocks)
        return out

    def insert(self, key: bytes, blocks: tuple[int, ...]) -> bool:
        """Register a request's computed block under `key`, referenced by it; False if the key is taken (another
        request computed the same prefix meanwhile: these blocks stay private)."""
        if key in self.entries:
            return False
        self.entries[key] = Entry(blocks, refs=1)
        return True

    def release(self, keys: list[bytes]) -> None:
        for k in keys:
            e = self.entries[k]
            e.refs -= 1
            if e.refs == 0:
                self._idle[k] = None
                self.num_evictable += len(e.blocks)

    def evict(self, num_blocks: int) -> None:
        """Free idle entries, least recently used first, until `num_blocks` blocks are free (or none is idle)."""
        while self.allocator.num_free < num_blocks and self._idle:
            key, _ = self._idle.popitem(last=False)
            blocks = self.entries.pop(key).blocks
            self.num_evictable -= len(blocks)
            self.allocator.free(list(blocks))

    def clear(self) -> None:
        """Free every idle entry; entries that running requests hold stay."""
        self.evict(self.allocator.num_blocks)

    def record(self, queried: int, hit: int) -> None:
        self.queried_tokens += queried
        self.hit_tokens += hit

    @property
    def hit_rate(self) -> Optional[float]:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else None
