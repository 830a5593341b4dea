"""What the chunks of call B's busy window hold: the same admission replayed on the CPU with the toy model (16
fresh prompts of 1,900 tokens at once, the default max_num_batched_tokens of 2,048; the toy's
max_position_embeddings is 2,048, so not call B's 2,048-token prompts), printing each of the first 20 plans'
decode rows and prompt chunks as (request, first position, tokens, loop).

    PYTHONPATH=$PWD python3 benchmarks/results/2026-12-07-session-7/admission_replay.py > admission_replay.txt
"""

import random

from ouro_backend import EngineConfig, LLMEngine, SamplingParams
from ouro_backend.entrypoints.bench import ensure_shape_checkpoint

eng = LLMEngine(EngineConfig.from_strings({"model": ensure_shape_checkpoint("toy")}))
plans = []
schedule = eng.scheduler.schedule
eng.scheduler.schedule = lambda: plans.append(schedule()) or plans[-1]
rng = random.Random(1)
vocab = eng.runner.model.cfg.vocab_size
params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
for i in range(16):
    eng.add_request(f"b{i}", [rng.randrange(3, vocab) for _ in range(1900)], params)
for _ in range(20):
    eng.step()
for k, plan in enumerate(plans[:20]):
    chunks = [(c.seq.request_id, c.start, c.n, c.loop) for c in plan.prefill]
    print(f"plan {k:2d}: {len(plan.decode_slots)} decode rows, chunks {chunks}")
