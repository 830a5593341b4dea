"""KV capacity: how many requests an engine admits and what it serves when clients ask for long
`max_tokens` but stop far earlier, through the public engine API only, so the same script times any
version of the engine (put the one to time first on PYTHONPATH).

A closed loop keeps --concurrency requests in flight (random prompt ids of --input-len tokens, greedy,
max_tokens --max-tokens, natural EOS: every --eos-every-th token id is an EOS id, so a random-weight
model stops on its own after about that many tokens). Reported: output tok/s, requests/s, the most
requests running at once, the mean output length, and the engine's preemption count where it has one.

    PYTHONPATH=. python benchmarks/kv_capacity.py --shape ouro-1.4b --concurrency 64 --out new.json
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="ouro-1.4b")
    p.add_argument("--model", default=None)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--eos-every", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--engine-arg", action="append", default=[])
    p.add_argument("--label", default="")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import ouro_backend
    from ouro_backend import EngineConfig, LLMEngine, SamplingParams
    from ouro_backend.bench import ensure_shape_checkpoint
    from ouro_backend.checkpoint import load_config

    model = args.model or ensure_shape_checkpoint(args.shape)
    vocab = load_config(model).vocab_size
    opts = dict(kv.split("=", 1) for kv in args.engine_arg)
    opts.update(model=model, eos_token_ids=",".join(str(i) for i in range(args.eos_every, vocab, args.eos_every)))
    engine = LLMEngine(EngineConfig.from_strings(opts))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(args.input_len)] for _ in range(args.num_requests)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    engine.add_request("warmup", prompts[0][:16], SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()

    submitted = finished = tokens = max_running = 0
    t0 = time.perf_counter()
    while finished < args.num_requests:
        while submitted < args.num_requests and submitted - finished < args.concurrency:
            engine.add_request(f"r{submitted}", prompts[submitted], params)
            submitted += 1
        for out in engine.step():
            if out.finished:
                finished += 1
                tokens += len(out.token_ids)
        max_running = max(max_running, engine.stats()["num_running"])
    wall = time.perf_counter() - t0
    stats = engine.stats()
    res = dict(label=args.label, engine=ouro_backend.__file__, command=" ".join(sys.argv), engine_options=
               {k: v for k, v in opts.items() if k != "eos_token_ids"}, eos_every=args.eos_every,
               input_len=args.input_len, max_tokens=args.max_tokens, concurrency=args.concurrency,
               num_requests=args.num_requests, kv_blocks=stats["kv_blocks_total"], wall_s=wall,
               output_tok_s=tokens / wall, requests_per_s=args.num_requests / wall, max_running=max_running,
               mean_output_len=tokens / args.num_requests, num_preemptions=stats.get("num_preemptions"))
    print(json.dumps(res))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
