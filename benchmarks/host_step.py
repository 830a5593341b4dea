"""Host time per engine step with the model's loop replaced by a no-op (CPU, toy checkpoint): the Python
bookkeeping of a round (scheduling, metadata, advance, coda, outputs) without any model compute.

    python benchmarks/host_step.py        (closed loop, c=64, 128 in / 64 out, 128 requests; median of 5)
"""

import statistics

from ouro_backend import EngineConfig, LLMEngine
from ouro_backend.entrypoints.bench import run_closed_loop

eng = LLMEngine(EngineConfig(exit_mode="trace", max_num_seqs=64, device="cpu"))
eng.model.loop = lambda h, positions, meta, kv: h
for workload in ["full", "trace=2.5"]:
    run_closed_loop(eng, 128, 64, 64, 128, workload)
    per_step = []
    for _ in range(5):
        r = run_closed_loop(eng, 128, 64, 64, 128, workload)
        per_step.append(r["mean_step_ms"])
    print(f"{workload}: {r['steps']} steps, host {statistics.median(per_step):.3f} ms/step (median of 5)")
