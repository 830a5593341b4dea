"""The engine's KV blocks: which are free, which requests hold, and which prompt prefixes they cache.

One class owns every block id (docs/kv-memory.md). A block is in exactly one of three states:

* free: on the free list, handed out first-in first-out by `take`;
* held by a request: in its block tables, given back with `free`;
* held by a prefix-cache entry ("Prefix caching" below): owned by the entry, referenced by the requests
  that read it, and, once no request does, idle: still cached, but counted as available, and evicted
  (least recently used first) when `take` finds the free list short.

Prefix caching (`enable_prefix_caching`). A full prompt block is identified by the SHA-256 of its tokens
chained with the key of the blocks before it, so equal keys mean equal prefixes. (A cryptographic hash,
because a key collision would hand one request another's KV: a client able to craft colliding prompts
could read what others' prompts make the model say.) Under LAST_EXITED a prompt position runs every loop,
so its KV in each plane is a function of that prefix alone: an entry holds the block of every plane and
any request whose prompt starts with the same full blocks reads them instead of computing them. (SHARED
keeps only the last plane of a prompt, and a suffix's prefill needs the others, so the engine refuses to
cache under it.) The pool lives with its engine, whose model, dtype and layout are fixed, so the key is
the tokens alone. With caching off, nothing is ever cached: `match` finds nothing.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass


@dataclass
class _Entry:
    blocks: tuple[int, ...]  # one per plane
    refs: int = 0


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free: deque[int] = deque(range(num_blocks))
        self._entries: dict[bytes, _Entry] = {}
        self._idle: OrderedDict[bytes, None] = OrderedDict()  # keys with refs == 0, least recently used first
        # NOTE: the blocks of the idle entries, kept in step with `_idle` (read on every admission), and of
        # all entries, kept in step with `_entries` (read with every metrics report).
        self._num_idle_blocks = 0
        self._num_cached_blocks = 0
        self.queried_tokens = self.hit_tokens = 0

    # ---- blocks ----
    @property
    def num_free(self) -> int:
        """Blocks on the free list."""
        return len(self._free)

    @property
    def num_idle_blocks(self) -> int:
        """Blocks of idle cache entries (cached, held by no request: `take` may evict them)."""
        return self._num_idle_blocks

    @property
    def num_available(self) -> int:
        """Blocks `take` can hand out: free, or held only by idle cache entries."""
        return len(self._free) + self._num_idle_blocks

    @property
    def usage(self) -> float:
        """Share of the blocks in use (blocks of idle cache entries count as free)."""
        return 1.0 - self.num_available / self.num_blocks

    def take(self, n: int) -> list[int]:
        """n blocks, evicting idle cache entries if the free list is short. Raises RuntimeError, taking
        nothing, when fewer than n are available."""
        if n > self.num_available:
            raise RuntimeError(f"KV cache: asked for {n} blocks, {self.num_available} available")
        self._evict(n)
        return [self._free.popleft() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        """Give a request's own blocks back (never blocks of a cache entry)."""
        self._free.extend(blocks)

    # ---- prefix caching ----
    def keys(self, tokens: list[int]) -> list[bytes]:
        """The chained key of every full block of `tokens`."""
        keys, h, bs = [], b"", self.block_size
        for i in range(len(tokens) // bs):
            h = hashlib.sha256(h + array("q", tokens[i * bs : (i + 1) * bs]).tobytes()).digest()
            keys.append(h)
        return keys

    def match(self, keys: list[bytes]) -> list[bytes]:
        """The longest run of `keys` from the start that the cache holds."""
        n = 0
        while n < len(keys) and keys[n] in self._entries:
            n += 1
        return keys[:n]

    def is_cached(self, key: bytes) -> bool:
        return key in self._entries

    def idle_blocks(self, keys: list[bytes]) -> int:
        """Blocks of these entries that now count as available (acquiring them takes them out of that)."""
        return sum(len(self._entries[k].blocks) for k in keys if k in self._idle)

    def acquire(self, keys: list[bytes]) -> list[tuple[int, ...]]:
        """Take a reference on each entry; returns their blocks."""
        out = []
        for k in keys:
            e = self._entries[k]
            e.refs += 1
            if k in self._idle:
                del self._idle[k]
                self._num_idle_blocks -= len(e.blocks)
            out.append(e.blocks)
        return out

    def insert(self, key: bytes, blocks: tuple[int, ...]) -> bool:
        """Hand a request's computed blocks to a new entry under `key`, referenced by that request; False if
        the key is taken (another request computed the same prefix meanwhile: these blocks stay the
        request's own)."""
        if not self.enable_prefix_caching:
            raise RuntimeError("prefix caching is off: nothing can be cached")
        if key in self._entries:
            return False
        self._entries[key] = _Entry(blocks, refs=1)
        self._num_cached_blocks += len(blocks)
        return True

    def release(self, keys: list[bytes]) -> None:
        """Drop one reference on each entry; an entry no request references becomes idle. Raises, changing
        nothing, for a key that is not cached or not referenced (a double release)."""
        for k in keys:
            e = self._entries.get(k)
            if e is None or e.refs <= 0:
                raise RuntimeError(
                    f"prefix cache: releasing {k.hex()[:16]}, which "
                    f"{'is not cached' if e is None else 'no request holds'}"
                )
        for k in keys:
            e = self._entries[k]
            e.refs -= 1
            if e.refs == 0:
                self._idle[k] = None
                self._num_idle_blocks += len(e.blocks)

    def blocks_of(self, key: bytes) -> tuple[int, ...]:
        """The blocks of the entry under `key` (one per plane)."""
        return self._entries[key].blocks

    def refs(self, key: bytes) -> int:
        """How many requests hold the entry under `key` (0: idle)."""
        return self._entries[key].refs

    @property
    def num_cached_blocks(self) -> int:
        """Blocks the cache entries own (held or idle)."""
        return self._num_cached_blocks

    @property
    def num_entries(self) -> int:
        return len(self._entries)

    def _evict(self, num_free: int) -> None:
        """Free idle entries, least recently used first, until `num_free` blocks are free (or none is idle)."""
        while len(self._free) < num_free and self._idle:
            key, _ = self._idle.popitem(last=False)
            blocks = self._entries.pop(key).blocks
            self._num_idle_blocks -= len(blocks)
            self._num_cached_blocks -= len(blocks)
            self._free.extend(blocks)

    def clear_cache(self) -> None:
        """Free every idle entry; entries that running requests hold stay."""
        self._evict(self.num_blocks)

    def record(self, queried: int, hit: int) -> None:
        """Count an admission's prompt tokens and how many of them were found cached."""
        self.queried_tokens += queried
        self.hit_tokens += hit

    @property
    def hit_rate(self) -> float | None:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else None
