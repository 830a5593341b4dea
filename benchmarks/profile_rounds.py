"""Where a round's time goes on the GPU: cProfile of the engine loop (sync points show GPU time)."""
import cProfile
import os
import pstats
import sys

from ouro_backend import EngineConfig, LLMEngine
from ouro_backend.bench import ensure_shape_checkpoint, run_closed_loop

workloads = sys.argv[1:] or ["full", "trace=2.5"]
eng = LLMEngine(EngineConfig(model=ensure_shape_checkpoint("ouro-1.4b"), exit_mode="trace", max_num_seqs=64))
run_closed_loop(eng, 128, 64, 64, 64, "full")  # warm-up
for w in workloads:
    pr = cProfile.Profile()
    pr.enable()
    r = run_closed_loop(eng, 128, 64, 64, 128, w)
    pr.disable()
    print(f"== {w}: {r['output_tok_s']:.0f} tok/s, {r['rounds']} rounds, {r['mean_round_ms']:.2f} ms/round")
    pstats.Stats(pr).sort_stats("tottime").print_stats(int(os.environ.get("TOP", "16")))
