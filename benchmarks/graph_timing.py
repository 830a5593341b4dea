"""Timing CUDA graphs for the GPU benchmarks: median replay time with CUDA events, after warm-up."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def replay_ms(graph: torch.cuda.CUDAGraph, replays: int = 30, warmup: int = 3) -> float:
    """Median ms of one replay of `graph` (CUDA events around each replay)."""
    ts = []
    for _ in range(replays + warmup):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e))
    return statistics.median(ts[warmup:])


def graph_ms(fn: Callable[[], object], replays: int = 30) -> float:
    """Median ms of `fn()` captured as one CUDA graph (run once on a side stream first: compiles, workspaces)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return replay_ms(g, replays)
