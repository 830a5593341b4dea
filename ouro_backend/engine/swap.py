"""Preempted requests in host memory (docs/kv-memory.md): their KV blocks and their decode-state rows.

The scheduler preempts by planning a `SwapOut`; the runner saves the row and the blocks here before the
launch that switches the row off, so the copy sees the state every earlier launch left (stream order),
and no later launch can overwrite the freed blocks before they are read. Resuming (`SwapIn`) copies the
blocks into new ones and writes the row back in a free slot with its new block tables: the request goes
on exactly where it stopped, in any layout and exit mode, sampled or speculated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .decode_state import DecodeState, SavedRow
from .kv_cache import KVCache
from .penalties import PenaltyState, SavedPenalties

CHUNK_BLOCKS = 32  # blocks per copy: bounds the device-side gather buffer


@dataclass
class _Saved:
    row: SavedRow
    kv: torch.Tensor  # host [layers, 2, blocks, block_size, kv_heads, head_dim], pinned on CUDA
    counts: list[int]  # blocks per plane, in the order of `kv`
    penalties: SavedPenalties | None  # None: the request has no penalties


class SwapStore:
    def __init__(
        self,
        kv: KVCache,
        state: DecodeState,
        penalties: PenaltyState,
        to_dev: Callable[[list, torch.dtype], torch.Tensor],
    ):
        self.kv, self.state, self.penalties, self.to_dev = kv, state, penalties, to_dev
        self.saved: dict[str, _Saved] = {}

    def save(self, key: str, slot: int, blocks: list[int], counts: list[int]) -> None:
        pool = self.kv.kv
        shape = (*pool.shape[:2], len(blocks), *pool.shape[3:])
        host = torch.empty(shape, dtype=pool.dtype, pin_memory=pool.is_cuda)
        for i in range(0, len(blocks), CHUNK_BLOCKS):
            idx = self.to_dev(blocks[i : i + CHUNK_BLOCKS], torch.long)
            host[:, :, i : i + len(idx)].copy_(pool.index_select(2, idx), non_blocking=True)
        self.saved[key] = _Saved(self.state.save_row(slot), host, counts, self.penalties.save(slot))

    def restore(self, key: str, slot: int, tables: list[list[int]]) -> None:
        s, st, pool = self.saved.pop(key), self.state, self.kv.kv
        dest = [b for plane, n in zip(tables, s.counts) for b in plane[:n]]
        for i in range(0, len(dest), CHUNK_BLOCKS):
            idx = self.to_dev(dest[i : i + CHUNK_BLOCKS], torch.long)
            pool.index_copy_(2, idx, s.kv[:, :, i : i + len(idx)].to(pool.device, non_blocking=True))
        rows = [t[: st.max_blocks] + [0] * (st.max_blocks - len(t[: st.max_blocks])) for t in tables]
        st.restore_row(
            slot, s.row, self.to_dev([b for r in rows for b in r], torch.int32).view(st.num_loops, st.max_blocks)
        )
        self.penalties.restore(slot, s.penalties)

    def drop(self, key: str) -> None:
        self.saved.pop(key, None)
