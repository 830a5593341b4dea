"""Depth-aware paged KV cache (docs/model.md, "KV cache layouts").

All planes share one pool of physical blocks; a request owns one block table per plane. A row of the
recurrent batch reads and writes exactly one plane, so depth awareness reduces to choosing the table:

* LAST_EXITED: T planes per request; loop d reads/writes plane d. When a token exits after loop e < T,
  its KV at plane e is copied into planes e+1..T (that position only), so deeper queries see it.
* SHARED: the prompt is prefilled with T planes (loop d among the prompt, as above); once prefill is
  done only the last plane is kept and every decode loop reads/writes it, overwriting the token's KV
  loop after loop, so earlier tokens are seen at their exit loop.

Block ids come from the engine's one `BlockPool` (`block_pool.py`), which also caches prompt prefixes.
Blocks are taken on demand (docs/kv-memory.md): a request gets its prompt's blocks in every plane at
admission, and its decode planes grow as its frontier advances, a few launches ahead of the device. A
plane's table only ever grows at its end, so a block id, once written to the device's table row, stays.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..config import KVLayout
from .block_pool import BlockPool


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        num_loops: int,
        layout: KVLayout,
        dtype: torch.dtype,
        device: torch.device,
        enable_prefix_caching: bool = False,
    ):
        self.layout = KVLayout(layout)
        self.block_size = block_size
        self.num_loops = num_loops
        self._decode_planes = (  # see decode_planes()
            range(num_loops) if self.layout is KVLayout.LAST_EXITED else range(num_loops - 1, num_loops)
        )
        self.pool = BlockPool(num_blocks, block_size, enable_prefix_caching)
        # [layers, K/V, blocks, block_size, kv_heads, head_dim]: a layer's K (or V) is one contiguous pool.
        self.kv = torch.zeros(num_layers, 2, num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=device)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one plane (all layers, K and V)."""
        return self.kv[:, :, 0].numel() * self.kv.element_size()

    def decode_planes(self) -> range:
        """The planes decode rows write: all of them (LAST_EXITED) or the last (SHARED)."""
        return self._decode_planes

    def _plane_len(self, plane: int, prompt_len: int, horizon: int) -> int:
        """Positions plane `plane` covers for a request that may write positions < horizon."""
        return max(prompt_len, horizon) if plane in self.decode_planes() else prompt_len

    def blocks_needed(self, prompt_len: int, horizon: int) -> int:
        """Blocks a request needs in all planes to write positions < horizon (its whole request: the most it
        can ever hold)."""
        return sum(self.blocks_for(self._plane_len(p, prompt_len, horizon)) for p in range(self.num_loops))

    def allocate(self, prompt_len: int, horizon: int, shared: Sequence[tuple[int, ...]] = ()) -> list[list[int]]:
        """One block table per plane (T of them; SHARED's first T-1 cover only the prompt). `shared`: leading
        blocks that are already there (prefix-cache hits), one tuple per block with one id per plane. Takes
        all the new blocks at once: short of blocks, it raises and takes none."""
        counts = [self.blocks_for(self._plane_len(p, prompt_len, horizon)) - len(shared) for p in range(self.num_loops)]
        new = iter(self.pool.take(sum(counts)))
        return [[b[p] for b in shared] + [next(new) for _ in range(n)] for p, n in enumerate(counts)]

    def growth_needed(self, tables: list[list[int]], horizon: int) -> int:
        """Blocks the decode planes need to cover positions < horizon. NOTE the scheduler asks it of every
        decoding request on every step: a plain loop over `decode_planes`, fixed at construction."""
        want = self.blocks_for(horizon)
        need = 0
        for p in self._decode_planes:
            short = want - len(tables[p])
            if short > 0:
                need += short
        return need

    def grow(self, tables: list[list[int]], horizon: int) -> list[tuple[int, int, int]]:
        """Extend the decode planes to cover positions < horizon; returns (plane, index, block) per new block,
        for the device's copy of the tables."""
        want = self.blocks_for(horizon)
        blocks = iter(self.pool.take(self.growth_needed(tables, horizon)))  # all or none
        new = []
        for p in self.decode_planes():
            add = [next(blocks) for _ in range(max(0, want - len(tables[p])))]
            new += [(p, len(tables[p]) + i, b) for i, b in enumerate(add)]
            tables[p].extend(add)
        return new

    def release_prefill_planes(self, tables: list[list[int]]) -> None:
        """SHARED: the prompt keeps only its final plane once prefill is complete."""
        if self.layout is KVLayout.SHARED:
            for plane in range(self.num_loops - 1):
                self.pool.free(tables[plane])
                tables[plane] = []

    def free(self, tables: list[list[int]], keep: int = 0) -> None:
        """Free every table's blocks but the first `keep` (prefix-cache blocks: their entries own them)."""
        for t in tables:
            self.pool.free(t[keep:])
            t.clear()

    def kv_slots(self, table: list[int], start: int, end: int) -> list[int]:
        """`kv_slot` of positions start..end-1."""
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def kv_slot(self, table: list[int], pos: int) -> int:
        """Where position `pos` of a plane with block table `table` lives in the pool (block x size + offset)."""
        return table[pos // self.block_size] * self.block_size + pos % self.block_size
