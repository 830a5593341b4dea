"""KV capacity: how many requests an engine admits and what it serves when clients ask for long
`max_tokens` but stop far earlier, through the public engine API only, so the same script times any
version of the engine (put the one to time first on PYTHONPATH).

A closed loop keeps --concurrency requests in flight: random prompt ids (--input-len tokens after an
optional --shared-prefix-len tokens that every prompt shares), max_tokens --max-tokens, and natural EOS:
every --eos-every-th token id is an EOS id. Sampling at temperature 1 (seeded per request) on random
weights spreads each token over the vocabulary almost evenly, so a request stops about --eos-every tokens
after its --min-tokens (a geometric length past min_tokens, during which EOS cannot end it); greedy
decoding of random weights falls into repeats that seldom hit an EOS id. Reported per repeat and as medians: output
tok/s, requests/s, the most requests running at
once, the mean output length, TTFT (submission to first token, seen by this loop), prompt tokens taken from
the prefix cache, and the engine's preemption count where it has one.

    PYTHONPATH=. python benchmarks/kv_capacity.py --shape ouro-1.4b --concurrency 64 --out new.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def run_once(engine, params_for, prompts: list[list[int]], concurrency: int, tag: str) -> dict:
    """One closed-loop pass over `prompts`; returns its measurements."""
    n = len(prompts)
    submitted = finished = tokens = max_running = cached = 0
    sent: dict[str, float] = {}
    ttft: list[float] = []
    t0 = time.perf_counter()
    while finished < n:
        while submitted < n and submitted - finished < concurrency:
            rid = f"{tag}-{submitted}"
            sent[rid] = time.perf_counter()
            engine.add_request(rid, prompts[submitted], params_for(submitted))
            submitted += 1
        for out in engine.step():
            if out.request_id in sent and (out.new_token_ids or out.token_ids):
                ttft.append(time.perf_counter() - sent.pop(out.request_id))
            if out.finished:
                finished += 1
                tokens += len(out.token_ids)
                cached += getattr(out, "num_cached_tokens", 0)
        max_running = max(max_running, engine.stats()["num_running"])
    wall = time.perf_counter() - t0
    return dict(
        wall_s=wall,
        output_tok_s=tokens / wall,
        requests_per_s=n / wall,
        max_running=max_running,
        mean_output_len=tokens / n,
        ttft_p50_ms=1e3 * pct(ttft, 0.5),
        ttft_p90_ms=1e3 * pct(ttft, 0.9),
        mean_cached_tokens=cached / n,
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="ouro-1.4b")
    p.add_argument("--model", default=None)
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens after the shared prefix")
    p.add_argument("--shared-prefix-len", type=int, default=0, help="tokens every prompt starts with")
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--eos-every", type=int, default=256)
    p.add_argument("--min-tokens", type=int, default=0, help="EOS cannot end a request before this many tokens")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--repeats", type=int, default=1, help="passes with fresh prompts (seed = repeat)")
    p.add_argument("--engine-arg", action="append", default=[])
    p.add_argument("--label", default="")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import ouro_backend
    from ouro_backend import EngineConfig, LLMEngine, SamplingParams

    try:
        from ouro_backend.entrypoints.bench import ensure_shape_checkpoint
        from ouro_backend.model.checkpoint import load_config
    except ImportError:  # an engine from before the package was split into subpackages (5d69360)
        from ouro_backend.bench import ensure_shape_checkpoint
        from ouro_backend.checkpoint import load_config

    model = args.model or ensure_shape_checkpoint(args.shape)
    vocab = load_config(model).vocab_size
    opts = dict(kv.split("=", 1) for kv in args.engine_arg)
    opts.update(model=model, eos_token_ids=",".join(str(i) for i in range(args.eos_every, vocab, args.eos_every)))
    engine = LLMEngine(EngineConfig.from_strings(opts))
    engine.add_request("warmup", list(range(3, 19)), SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()

    runs = []
    for rep in range(args.repeats):
        rng = random.Random(rep)
        prefix = [rng.randrange(3, vocab) for _ in range(args.shared_prefix_len)]
        prompts = [prefix + [rng.randrange(3, vocab) for _ in range(args.input_len)] for _ in range(args.num_requests)]

        def params_for(i: int, rep: int = rep) -> SamplingParams:
            return SamplingParams(
                max_tokens=args.max_tokens,
                min_tokens=args.min_tokens,
                temperature=args.temperature,
                seed=rep * 1_000_003 + i,
            )

        r = run_once(engine, params_for, prompts, args.concurrency, f"rep{rep}")
        print(json.dumps(dict(repeat=rep, **r)), flush=True)
        runs.append(r)
    stats = engine.stats()
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    res = dict(
        label=args.label,
        engine=ouro_backend.__file__,
        command=" ".join(sys.argv),
        engine_options={k: v for k, v in opts.items() if k != "eos_token_ids"},
        eos_every=args.eos_every,
        min_tokens=args.min_tokens,
        temperature=args.temperature,
        input_len=args.input_len,
        shared_prefix_len=args.shared_prefix_len,
        max_tokens=args.max_tokens,
        concurrency=args.concurrency,
        num_requests=args.num_requests,
        kv_blocks=stats["kv_blocks_total"],
        num_preemptions=stats.get("num_preemptions"),
        num_recomputes=stats.get("num_recomputes"),
        prefix_cache_hit_rate=stats.get("prefix_cache_hit_rate"),
        kv_blocks_free_after=stats["kv_blocks_free"],
        median=med,
        repeats=runs,
    )
    print(json.dumps(res))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
