"""Host time of the scheduler per decode step, model-free (CPU): `schedule()` + `launched()` with N requests
decoding (128-token prompts, prefix caching on, block size 16, last_exited), median over 200 steps, median of
5 runs. The engine pays this on every step, beside the runner's own host work (benchmarks/host_step.py).

    python benchmarks/scheduler_step.py [--requests 64 256]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ouro_backend.config import EngineConfig, KVLayout
from ouro_backend.engine.kv_cache import KVCache
from ouro_backend.engine.scheduler import Scheduler
from ouro_backend.engine.sequence import Sequence, StopChecker
from ouro_backend.sampling_params import SamplingParams


def step_us(n: int, steps: int = 200) -> float:
    cfg = EngineConfig(
        block_size=16, max_num_seqs=n, max_num_batched_tokens=max(8192, n), enable_prefix_caching=True
    ).validate()
    kv = KVCache(1, 40_000, 16, 1, 2, 4, KVLayout(cfg.kv_layout), torch.float32, torch.device("cpu"), True)
    s = Scheduler(cfg, kv, 4)
    for i in range(n):
        prompt = list(range(1000 * i, 1000 * i + 128))
        s.add(Sequence(f"r{i}", prompt, SamplingParams(max_tokens=10_000), 0, StopChecker([])))
    while any(seq.in_prefill for seq in s.running) or s.waiting:  # admit and prefill every request
        plan = s.schedule()
        s.launched(plan)
        for seq in s.running:
            if not seq.in_prefill:
                seq.append_token(1, 4, 0.0)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        plan = s.schedule()
        s.launched(plan)
        times.append(time.perf_counter() - t)
        for seq in s.running:  # the token the device would have produced
            seq.append_token(1, 4, 0.0)
    assert len(plan.decode_slots) == n, (len(plan.decode_slots), n)
    return statistics.median(times) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, nargs="+", default=[64, 256])
    args = p.parse_args()
    for n in args.requests:
        runs = [step_us(n) for _ in range(5)]
        print(
            f"{n} decoding requests: schedule() + launched() {statistics.median(runs):.0f} us per step "
            f"(runs {', '.join(f'{r:.0f}' for r in runs)})"
        )


if __name__ == "__main__":
    main()
