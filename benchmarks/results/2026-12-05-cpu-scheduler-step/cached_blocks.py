"""What reading `BlockPool.num_cached_blocks` costs with 10,000 prefix-cache entries (4 blocks each), against
the sum over every entry that it was before the counter (`LLMEngine.stats()` reads it for every metrics report).

    PYTHONPATH=$PWD python benchmarks/results/2026-12-05-cpu-scheduler-step/cached_blocks.py
"""

from __future__ import annotations

import json
import time

from ouro_backend.engine.block_pool import BlockPool


def per_call_us(fn, n: int = 200) -> float:
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


def main() -> None:
    pool = BlockPool(40_000, 16, enable_prefix_caching=True)
    for i in range(10_000):
        pool.insert(pool.keys(list(range(16 * i, 16 * i + 16)))[0], tuple(pool.take(4)))
    entries = pool._entries  # the pool's own state, read here only to time the old sum against it
    old = sum(len(e.blocks) for e in entries.values())
    assert old == pool.num_cached_blocks == 40_000
    print(
        json.dumps(
            {
                "entries": len(entries),
                "counter_us": round(per_call_us(lambda: pool.num_cached_blocks), 2),
                "sum_over_entries_us": round(per_call_us(lambda: sum(len(e.blocks) for e in entries.values())), 1),
            }
        )
    )


if __name__ == "__main__":
    main()
