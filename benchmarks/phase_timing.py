"""Per-phase wall time of engine rounds on the GPU (full depth vs trace early exit), device-synced."""
import sys
import time
from collections import defaultdict

import torch

from ouro_backend import EngineConfig, LLMEngine
from ouro_backend import runner as runner_mod
from ouro_backend.bench import ensure_shape_checkpoint, run_closed_loop

acc = defaultdict(float)


def timed(obj, name, label=None):
    fn = getattr(obj, name)

    def wrapper(*a, **k):
        t = time.perf_counter()
        r = fn(*a, **k)
        torch.cuda.synchronize()
        acc[label or name] += time.perf_counter() - t
        return r
    setattr(obj, name, wrapper)


eng = LLMEngine(EngineConfig(model=ensure_shape_checkpoint("ouro-1.4b"), exit_mode="trace", max_num_seqs=64))
r = eng.runner
for n in ("_metadata", "_gather_inputs", "_run_graph", "_prepare"):
    timed(r, n)
timed(eng.model, "logits")
timed(eng.model, "loop", "model.loop (eager rounds)")
timed(eng.policy, "step", "policy.step")
timed(eng.kv, "exit_fill_slots")
timed(r.staging, "next_round", "staging.next_round")
timed(eng.model.backend, "copy_kv_slots")
timed(runner_mod, "sample")
timed(eng.scheduler, "schedule")
timed(eng, "_append")
timed(r, "launch", "runner.launch total")
timed(eng, "step", "engine.step total")
run_closed_loop(eng, 128, 64, 64, 64, "full")
run_closed_loop(eng, 128, 64, 64, 64, "trace=2.5")
for w in sys.argv[1:] or ["full", "trace=2.5"]:
    acc.clear()
    res = run_closed_loop(eng, 128, 64, 64, 128, w)
    n = res["rounds"]
    print(f"== {w}: {res['output_tok_s']:.0f} tok/s, {n} rounds ({res['graph_rounds']} graph), "
          f"{res['mean_round_ms']:.2f} ms/round")
    for k, v in sorted(acc.items(), key=lambda kv: -kv[1]):
        print(f"   {k:<22}{v * 1e3 / n:8.3f} ms/round")
