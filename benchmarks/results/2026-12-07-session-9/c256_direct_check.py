"""Call D's check (session 9): engine-direct C256 64/64 at 256 rows as served.py's direct phase runs it (a
warm-up request, then prompts of varying length: 56-71 tokens), then a device sync, so that a CUDA error
left by any launch is raised here with its traceback instead of at the interpreter's exit. Run from a tree's
root: python3 c256_direct_check.py CHECKPOINT [threshold]."""

import gc
import json
import random
import sys
import time

import torch

from ouro_backend import EngineConfig, LLMEngine, SamplingParams
from ouro_backend.entrypoints.bench import run_closed_loop

ckpt = sys.argv[1]
threshold = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
eng = LLMEngine(EngineConfig(model=ckpt, max_num_seqs=256))
V = eng.model_config.vocab_size
rng = random.Random(7)
eng.add_request("warmup", [rng.randrange(3, V) for _ in range(64)], SamplingParams(max_tokens=4, ignore_eos=True))
while eng.has_unfinished_requests():
    eng.step()
prompts = [[rng.randrange(3, V) for _ in range(rng.randint(56, 71))] for _ in range(1024)]
workload = "full" if threshold >= 1 else f"threshold={threshold}"
t0 = time.monotonic()
r = run_closed_loop(eng, 64, 64, 256, 1024, workload, prompts=prompts)
torch.cuda.synchronize()
print("synced after the run", round(time.monotonic() - t0, 2), "s", flush=True)
keys = ("output_tok_s", "mean_exit_depth", "launches", "graph_launches", "eager_launches")
print(json.dumps({k: r.get(k) for k in keys}))
del eng
gc.collect()
torch.cuda.synchronize()
print("ok: engine freed and synced", flush=True)
