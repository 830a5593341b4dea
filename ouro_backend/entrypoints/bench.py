"""`ouro-bench`: engine-direct benchmarks with a baseline timed in the same run.

Closed loop: `concurrency` requests are in flight; each one that finishes is replaced until
`num_requests` are done. Or open loop (`--arrival-rate`): Poisson arrivals. Fixed input lengths, random
prompt ids, greedy; EOS ignored (fixed output lengths) unless `--natural-eos`.
Every engine step is timed and labelled with the round it launched. With asynchronous scheduling a step
waits for the previous round, so the split below is approximate at the boundaries between kinds of rounds
(exact with async_scheduling=false, where a round that emits tokens ends in their read-back):

* prefill tok/s: prompt tokens / time of the rounds that carry prompt work (mixed rounds count here);
* decode tok/s: tokens emitted by decode-only rounds / their time; "steady" keeps only the rounds in
  which all `concurrency` requests were running.

Workloads: `full` (fixed depth), `threshold=X` (the exit gate), `depth=D` (the exit gate at the threshold
whose mean exit depth on the run's prompts is about D: found for each repeat by bisection over untimed runs
of that repeat's prompts, each repeat's reported as `threshold`), `trace=MEAN` (per-request depth lists
built from the loop depths with the requested mean, replayed by exit_mode=trace). Every timed run starts
with an empty prefix cache, so no run reuses an earlier run's prefill.

Where the time goes with early exit: `decode_occupancy` is the share of slot-rounds that carried a decode
loop (1.0: every one of `concurrency` rows busy in every round), and `tail_frac` the share of the wall time
spent after the last request was submitted with fewer than `concurrency` requests running. With the real
gate each request has its own mean depth, so a closed run ends on its deepest requests. `ideal_rounds` (closed
loop) is the fewest rounds any engine that advances a request by one loop per round could take on the run's
requests with their exit depths (`ideal_rounds()`), against `rounds`, what this engine took.
"""

from __future__ import annotations

import argparse
import heapq
import json
import logging
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from ..config import EngineConfig
from ..engine.llm_engine import LLMEngine
from ..engine.spec_policy import mean_accepted_length
from ..sampling_params import SamplingParams

log = logging.getLogger(__name__)


def ensure_shape_checkpoint(shape: str, loop_change: float = 1.0) -> str:
    """The random-weight checkpoint of `shape` under the cache dir (built once); `loop_change` < 1 makes a
    variant whose early loops agree more with the last (toy.init_weight)."""
    from ..model.toy import default_toy_path, write_checkpoint

    path = default_toy_path().parent / (shape if loop_change == 1.0 else f"{shape}-loopchange{loop_change:g}")
    if not (path / "config.json").is_file():
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        write_checkpoint(tmp, shape=shape, verbose=True, loop_change=loop_change)
        os.replace(tmp, path)
    return str(path)


def trace_for_mean(mean: float, num_loops: int, length: int, rng: random.Random) -> list[int]:
    """A depth list with exactly the requested mean (to 1/length), shuffled per request."""
    total = round(mean * length)
    depths = [1] * length
    i = 0
    while sum(depths) < total:
        if depths[i % length] < num_loops:
            depths[i % length] += 1
        i += 1
    rng.shuffle(depths)
    return depths


def ideal_rounds(loops: list[int], concurrency: int) -> int:
    """The rounds a closed loop needs when every round advances every running request by one loop and nothing
    else ever waits. `loops[i]`: request i's loops (its prompt's rounds, then each later token's exit depth), in
    submission order; `concurrency` in flight, each finished request replaced in the next round. No engine that
    runs one loop of a request per round finishes sooner, so at equal round cost full depth's ideal_rounds over
    an early-exit run's bounds the speedup any such engine can show on that run's requests."""
    free = [0] * min(concurrency, len(loops))  # when each slot is next free (a heap)
    for n in loops:
        heapq.heappush(free, heapq.heappop(free) + n)
    return max(free, default=0)


def percentiles(xs: list[float]) -> dict:
    if not xs:
        return {}
    xs = sorted(xs)
    pick = lambda q: xs[min(len(xs) - 1, int(q * len(xs)))]  # noqa: E731
    return dict(p50=pick(0.5), p90=pick(0.9), p99=pick(0.99), mean=sum(xs) / len(xs))


def run_closed_loop(
    engine: LLMEngine,
    input_len: int,
    output_len: int,
    concurrency: int,
    num_requests: int,
    workload: str,
    seed: int = 0,
    prompt_ids: list[int] | None = None,
    prompts: list[list[int]] | None = None,
    arrival_rate: float | None = None,
    ignore_eos: bool = True,
    min_output_len: int | None = None,
) -> dict:
    """One run; random prompts of input_len tokens unless prompt_ids (every request's) or prompts (one per
    request) is given. Closed loop (`concurrency`
    requests in flight), or with `arrival_rate` open loop: Poisson arrivals at that many requests/s, queued
    by the engine however many are running. ignore_eos=False lets requests end at EOS (natural lengths);
    `min_output_len` gives each request a max_tokens drawn uniformly from [min_output_len, output_len]
    (random weights almost never sample EOS, so this is how they end at staggered lengths)."""
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    T = engine.model_config.num_loops
    kind, _, arg = workload.partition("=")

    def params() -> SamplingParams:
        n = output_len if min_output_len is None else rng.randint(min_output_len, output_len)
        p = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=ignore_eos)
        if kind == "threshold":
            p.exit_threshold = float(arg)
        elif kind == "trace":
            p.exit_trace = trace_for_mean(float(arg), T, 16, rng)
        elif kind != "deferred":  # deferred: the engine's deferred deep batching sets every token's depth
            p.exit_threshold = 1.0
        return p

    submitted = finished = 0
    outs = []
    rounds = []  # (seconds, prompt tokens, decode rows, emitted, running)

    # Prompts and params are made before the clock starts: building them is not the engine's work.
    if prompts is not None and len(prompts) < num_requests:
        raise ValueError(f"{len(prompts)} prompts for {num_requests} requests")
    requests = [
        (
            prompts[i] if prompts is not None else prompt_ids or [rng.randrange(3, vocab) for _ in range(input_len)],
            params(),
        )
        for i in range(num_requests)
    ]
    # Calibration and earlier repeats ran these prompts (or the same seed's): their cached prefill would make
    # this run's prompts nearly free, and only the gated runs, which come later, would profit.
    engine.reset_prefix_cache()

    def submit():
        nonlocal submitted
        ids, p = requests[submitted]
        engine.add_request(f"b{submitted}", ids, p)
        submitted += 1

    arrivals = None
    if arrival_rate:  # seconds after the start at which each request arrives
        t, arrivals = 0.0, []
        for _ in range(num_requests):
            t += rng.expovariate(arrival_rate)
            arrivals.append(t)
    else:
        for _ in range(min(concurrency, num_requests)):
            submit()
    peak_kv = 0.0
    last_submit_step = 0
    runner = engine.runner
    stats0 = engine.stats()
    runner.timer.enabled = True
    runner.timer.take()  # forget earlier launches
    t_start = time.perf_counter()
    while finished < num_requests:
        if arrivals is not None:
            while submitted < num_requests and arrivals[submitted] <= time.perf_counter() - t_start:
                submit()
                last_submit_step = len(rounds)
            if not engine.has_unfinished_requests():  # idle until the next arrival
                time.sleep(max(0.0, arrivals[submitted] - (time.perf_counter() - t_start)))
                continue
        t0 = time.perf_counter()
        step_outs = engine.step()
        dt = time.perf_counter() - t0
        st = runner.last_round
        rounds.append(
            (dt, st["prefill_tokens"], st["decode_rows"], sum(len(o.new_token_ids) for o in step_outs), st["running"])
        )
        peak_kv = max(peak_kv, engine.kv.pool.usage)  # (stats() builds every statistic: not per step)
        for o in step_outs:
            if o.finished:
                finished += 1
                outs.append(o)
                if submitted < num_requests and arrivals is None:
                    submit()
                    last_submit_step = len(rounds)
    wall = time.perf_counter() - t_start
    gpu_span, gpu_busy, launches = runner.timer.take()
    runner.timer.enabled = False
    stats = {
        k: v - stats0[k]
        for k, v in engine.stats().items()
        if k
        in (
            "launches",
            "rounds",
            "host_syncs",
            "graph_launches",
            "eager_launches",
            "spec_steps",
            "spec_drafted",
            "spec_accepted",
            "num_preemptions",
            "deep_rounds",
            "deep_rows",
        )
    }
    # NOTE with async scheduling the last step launched work for requests that its read-back then finished:
    # collect it here, after the counts, so a run leaves nothing in flight for the next run (whose first step
    # would read it back) or for the process's exit.
    while engine.has_unfinished_requests():
        engine.step()
    spec_k = engine.config.spec_tokens
    gen = sum(len(o.token_ids) for o in outs)
    pre_t = sum(r[0] for r in rounds if r[1])
    dec = [r for r in rounds if not r[1] and r[2]]
    steady = [r for r in dec if r[4] >= concurrency]
    ttft = [o.first_token_time - o.arrival_time for o in outs]
    tpot = [(o.finish_time - o.first_token_time) / (len(o.token_ids) - 1) for o in outs if len(o.token_ids) > 1]
    depths = [d for o in outs for d in o.exit_depths[1:]]
    # Each request's own mean depth: with the real gate it varies by prompt, and the slowest request of the
    # last wave sets the end-to-end time (the tail).
    per_request = [sum(o.exit_depths[1:]) / (len(o.exit_depths) - 1) for o in outs if len(o.exit_depths) > 1]
    tail = sum(r[0] for r in rounds[last_submit_step:] if r[4] < concurrency)
    # Each request's loops in submission order: its prompt's rounds (one per loop its first token ran), then one
    # per loop of every later token.
    by_id = {o.request_id: o for o in outs}
    loops = [sum(by_id[f"b{i}"].exit_depths) for i in range(num_requests) if f"b{i}" in by_id]
    return dict(
        requests=len(outs),
        generated_tokens=gen,
        wall_s=wall,
        output_tok_s=gen / wall,
        cached_prompt_tokens=sum(o.num_cached_tokens for o in outs),
        prefill_tok_s=num_requests * input_len / pre_t if pre_t else None,
        decode_tok_s=sum(r[3] for r in dec) / sum(r[0] for r in dec) if dec else None,
        steady_decode_tok_s=sum(r[3] for r in steady) / sum(r[0] for r in steady) if steady else None,
        steady_round_ms=1e3 * statistics.median(r[0] for r in steady) if steady else None,
        ttft_s=percentiles(ttft),
        tpot_s=percentiles(tpot),
        mean_exit_depth=sum(depths) / len(depths) if depths else None,
        peak_kv_usage=peak_kv,
        request_depth=dict(percentiles(per_request), max=max(per_request, default=None)),
        steps=len(rounds),
        mean_step_ms=1e3 * wall / len(rounds),
        launches=stats["launches"],
        max_running=max((r[4] for r in rounds), default=0),
        preemptions=stats["num_preemptions"],
        rounds=stats["rounds"],
        rounds_per_token=stats["rounds"] / gen,
        host_syncs_per_token=stats["host_syncs"] / gen,
        gpu_idle_frac=1.0 - gpu_busy / gpu_span if gpu_span else None,
        decode_occupancy=sum(depths) / (stats["rounds"] * concurrency) if stats["rounds"] else None,
        spec_steps=stats["spec_steps"],
        spec_acceptance=stats["spec_accepted"] / stats["spec_drafted"] if stats["spec_drafted"] else None,
        spec_mean_accepted_length=(
            mean_accepted_length(stats["spec_drafted"], stats["spec_accepted"], spec_k)
            if stats["spec_drafted"]
            else None
        ),
        tail_frac=tail / wall,
        last_arrival_s=arrivals[-1] if arrivals else None,
        ideal_rounds=ideal_rounds(loops, concurrency) if arrivals is None else None,
        request_loops=sum(loops),
        graph_launches=stats["graph_launches"],
        eager_launches=stats["eager_launches"],
        gpu_s_by_launch=gpu_by_launch(launches),
        deferred_deep_interval=engine.config.deferred_deep_interval,
        deferred_deep_eager=engine.config.deferred_deep_eager,
        # Deferred deep batching: the deep chunk tokens of a round that ran any (N aligned requests: N x B).
        deep_rows_per_call=stats["deep_rows"] / stats["deep_rounds"] if stats["deep_rounds"] else None,
    )


TOKEN_BUCKETS = (128, 256, 512, 1024)
ROW_BUCKETS = (16, 32, 48, 64)


def _bucket(name: str, n: int, bounds: tuple[int, ...]) -> str:
    return next((f"{name}<={b}" for b in bounds if n <= b), f"{name}>{bounds[-1]}")


def gpu_by_launch(launches: list[tuple[float, int, int, int, bool]]) -> dict:
    """Device seconds, launches and rounds by kind of launch, and the device time of one round of each kind:
    prompt work alone (`prompt<=T`: T prompt tokens), prompt work with decode rows (`mixed<=T`), decode-only
    launches by their rows (`decode<=R`) and speculative steps (`spec<=R`): where a run's time went. Every
    kind is listed, empty ones too, so that repeats can take medians."""
    kinds = [
        *(f"prompt<={b}" for b in TOKEN_BUCKETS),
        f"prompt>{TOKEN_BUCKETS[-1]}",
        *(f"mixed<={b}" for b in TOKEN_BUCKETS),
        f"mixed>{TOKEN_BUCKETS[-1]}",
        *(f"decode<={b}" for b in ROW_BUCKETS),
        f"decode>{ROW_BUCKETS[-1]}",
        *(f"spec<={b}" for b in ROW_BUCKETS),
        f"spec>{ROW_BUCKETS[-1]}",
    ]
    out = {kind: dict(gpu_s=0.0, launches=0, rounds=0, ms_per_round=None) for kind in kinds}
    for sec, prompt, rows, rounds, speculative in launches:
        if prompt:
            kind = _bucket("mixed" if rows else "prompt", prompt, TOKEN_BUCKETS)
        else:
            kind = _bucket("spec" if speculative else "decode", rows, ROW_BUCKETS)
        k = out[kind]
        k["gpu_s"] += sec
        k["launches"] += 1
        k["rounds"] += rounds
    for k in out.values():
        if k["rounds"]:
            k["ms_per_round"] = 1e3 * k["gpu_s"] / k["rounds"]
    return out


# The prompt-work rate `loop_ideal_ratio` assumes: a fixed yardstick, not a measurement, so that the ratio
# does not move when the prompt kernels change.
PROMPT_FLOPS = 400e12


def loop_params(engine: LLMEngine) -> int:
    """Parameters of one loop: the shared stack's layers (embeddings, exit gate and LM head run once a token)."""
    return sum(t.numel() for layer in engine.model.layers for t in vars(layer).values())


def loop_metrics(gated: dict, full: dict, num_loops: int, prompt_seconds: float) -> dict:
    """How much of the ideal a gated run reaches against the full-depth run of the same requests.

    `loop_ideal_ratio` = T_full / (P + (T_full - P) x mean_depth / num_loops): the speed-up an engine would get
    whose every non-prompt second scaled with depth, with P (`prompt_seconds`: the run's prompt tokens x
    num_loops x 2 x loop parameters / PROMPT_FLOPS) the part that cannot shrink. `loop_efficiency` =
    `ratio_vs_full` / `loop_ideal_ratio`."""
    t_full = full["wall_s"]
    ratio = gated["output_tok_s"] / full["output_tok_s"]
    depth = gated["mean_exit_depth"]
    ideal = t_full / (prompt_seconds + (t_full - prompt_seconds) * depth / num_loops) if depth else None
    return dict(
        ratio_vs_full=ratio,
        prompt_s_yardstick=prompt_seconds,
        loop_ideal_ratio=ideal,
        loop_efficiency=ratio / ideal if ideal else None,
    )


def threshold_for_depth(
    engine: LLMEngine,
    target: float,
    input_len: int,
    output_len: int,
    concurrency: int,
    num_requests: int,
    seed: int = 0,
    iters: int = 7,
    prompts: list[list[int]] | None = None,
) -> tuple[float, float]:
    """The gate threshold whose mean exit depth on the run's prompts (seed `seed`) is closest to `target`
    (depth rises with the threshold), by bisection over untimed runs; returns (threshold, its depth). With
    `prompts` (iters x num_requests of them), run i takes the i-th num_requests: no prompt runs twice."""
    lo, hi, best = 0.0, 1.0, (1.0, float(engine.model_config.num_loops))
    for i in range(iters):
        mid = (lo + hi) / 2
        own = prompts[i * num_requests : (i + 1) * num_requests] if prompts is not None else None
        depth = run_closed_loop(
            engine, input_len, output_len, concurrency, num_requests, f"threshold={mid}", seed=seed, prompts=own
        )["mean_exit_depth"]
        if abs(depth - target) < abs(best[1] - target):
            best = (mid, depth)
        lo, hi = (mid, hi) if depth < target else (lo, mid)
    return best


def run_baseline(
    model_path: str, dtype: torch.dtype, device: torch.device, input_len: int, tokens: int, batch: int
) -> dict:
    from ..model.checkpoint import load_config, load_weights
    from .baseline import EagerBaseline

    cfg = load_config(model_path)
    base = EagerBaseline(cfg, load_weights(model_path, cfg, dtype, device))
    ids = torch.randint(3, cfg.vocab_size, (batch, input_len), device=device)
    base.generate(ids[:, :8], 2)  # warm-up
    r = base.generate(ids, tokens)
    del base
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return dict(
        batch=batch,
        tokens=tokens,
        prefill_tok_s=batch * input_len / r["prefill_s"],
        decode_tok_s=batch * (tokens - 1) / r["decode_s"],
        output_tok_s=batch * tokens / (r["prefill_s"] + r["decode_s"]),
    )


def median_of(runs: list[dict]) -> dict:
    out = {}
    for k, _v in runs[0].items():
        vals = [r[k] for r in runs]
        if all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in vals):
            out[k] = statistics.median(vals)
        elif all(isinstance(x, dict) for x in vals):
            out[k] = median_of(vals) if vals[0] else {}
        else:
            out[k] = vals[0]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ouro-bench", description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="checkpoint directory")
    src.add_argument(
        "--shape",
        choices=["toy", "ouro-1.4b", "ouro-2.6b"],
        default="toy",
        help="random-weight checkpoint of this shape (built once under the cache dir)",
    )
    p.add_argument(
        "--loop-change",
        type=float,
        default=1.0,
        help="with --shape: how much each loop of the random weights changes the state (1: default); "
        "smaller makes early loops agree more with the last (self-speculation's acceptance)",
    )
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--num-requests", type=int, default=None, help="per run (default: --waves x concurrency, >= 4)")
    p.add_argument("--waves", type=int, default=2, help="without --num-requests: requests per run = this x concurrency")
    p.add_argument(
        "--workload",
        nargs="+",
        default=["full"],
        help="full | threshold=X | depth=D | trace=MEAN | deferred (the only one, and the default, of an engine "
        "with deferred_deep_interval > 0)",
    )
    p.add_argument(
        "--arrival-rate",
        type=float,
        default=None,
        help="open loop: Poisson arrivals at this many requests/s (default: closed loop at --concurrency)",
    )
    p.add_argument(
        "--arrival-load",
        type=float,
        default=None,
        metavar="F",
        help="open loop at F x the capacity of full depth: each concurrency first runs one untimed closed "
        "full-depth run (its requests/s is `capacity_req_s`), then Poisson arrivals at F x that rate",
    )
    p.add_argument(
        "--calibration-requests",
        type=int,
        default=None,
        help="requests per untimed run of a depth=D bisection (default: the run's own number)",
    )
    p.add_argument(
        "--natural-eos",
        action="store_true",
        help="let requests stop at EOS (default: EOS ignored, every request makes --output-len tokens)",
    )
    p.add_argument(
        "--eos-every",
        type=int,
        default=None,
        metavar="N",
        help="with --natural-eos: every N-th token id counts as EOS, so a random-weight model (which "
        "almost never samples its one EOS id) stops on its own after about N tokens",
    )
    p.add_argument(
        "--min-output-len",
        type=int,
        default=None,
        help="each request's max_tokens uniform in [this, --output-len] (default: all --output-len)",
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--baseline", choices=["eager", "none"], default="eager")
    p.add_argument("--baseline-tokens", type=int, default=16, help="tokens per baseline run (it is slow)")
    p.add_argument(
        "--baseline-max-batch",
        type=int,
        default=64,
        help="largest baseline batch (its concatenated 4-plane cache needs ~0.8 MiB per token)",
    )
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="engine option (repeatable), e.g. kv_layout=shared",
    )
    p.add_argument("--out", help="write results JSON here")
    p.add_argument("--label", default="")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)

    if args.arrival_load is not None and (args.arrival_rate is not None or not 0 < args.arrival_load <= 2):
        p.error("--arrival-load F needs 0 < F <= 2 and no --arrival-rate")
    if args.min_output_len is not None and not 1 <= args.min_output_len <= args.output_len:
        p.error(f"--min-output-len must be in [1, --output-len={args.output_len}], got {args.min_output_len}")
    if args.model:
        model = args.model
    elif args.shape == "toy":
        from ..model.toy import ensure_toy_checkpoint

        model = ensure_toy_checkpoint()
    else:
        model = ensure_shape_checkpoint(args.shape, args.loop_change)
    opts = dict(kv.split("=", 1) for kv in args.engine_arg)
    opts["model"] = model
    if args.eos_every:
        if not args.natural_eos:
            p.error("--eos-every needs --natural-eos")
        from ..model.checkpoint import load_config

        vocab = load_config(model).vocab_size
        opts["eos_token_ids"] = ",".join(str(i) for i in range(args.eos_every, vocab, args.eos_every))
    if any(w.startswith("trace") for w in args.workload):
        if len({w.split("=")[0] for w in args.workload} - {"full"}) > 1:
            p.error("trace workloads need exit_mode=trace: run them separately from threshold workloads")
        opts.setdefault("exit_mode", "trace")
    cfg = EngineConfig.from_strings(opts)
    if cfg.deferred_deep_interval:
        if args.workload == ["full"]:
            args.workload = ["deferred"]
        if args.workload != ["deferred"]:
            p.error("an engine with deferred_deep_interval > 0 sets every token's depth: --workload deferred only")
    elif "deferred" in args.workload:
        p.error("--workload deferred needs --engine-arg deferred_deep_interval=B")
    results = dict(
        label=args.label,
        command=" ".join(["ouro-bench"] + (argv or sys.argv[1:])),
        engine_options=opts,
        input_len=args.input_len,
        output_len=args.output_len,
        arrival_rate=args.arrival_rate,
        arrival_load=args.arrival_load,
        natural_eos=args.natural_eos,
        min_output_len=args.min_output_len,
        eos_every=args.eos_every,
        device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        torch=torch.__version__,
        runs=[],
        baseline=[],
    )

    if args.baseline == "eager":
        from ..engine.llm_engine import resolve_device, resolve_dtype

        device = resolve_device(cfg.device)
        dtype = resolve_dtype(cfg.dtype, device)
        for c in args.concurrency:
            r = run_baseline(
                model, dtype, device, args.input_len, args.baseline_tokens, min(c, args.baseline_max_batch)
            )
            log.info("baseline c=%d: %.1f output tok/s", c, r["output_tok_s"])
            results["baseline"].append(r)

    engine = LLMEngine(cfg)
    engine.add_request("warmup", [5] * args.input_len, SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    rates: dict[int, float | None] = {c: args.arrival_rate for c in args.concurrency}
    if args.arrival_load is not None:
        results["capacity"] = []
        for c in args.concurrency:
            n = args.num_requests or max(args.waves * c, 4)
            cap = run_closed_loop(
                engine, args.input_len, args.output_len, c, n, "full", seed=10_000 + c, ignore_eos=not args.natural_eos
            )
            rates[c] = args.arrival_load * cap["requests"] / cap["wall_s"]
            log.info("capacity c=%d: %.2f requests/s; open loop at %.2f", c, cap["requests"] / cap["wall_s"], rates[c])
            results["capacity"].append(
                dict(concurrency=c, capacity_req_s=cap["requests"] / cap["wall_s"], arrival_rate=rates[c])
            )
    for workload in args.workload:
        for c in args.concurrency:
            n = args.num_requests or max(args.waves * c, 4)
            reps = []
            for rep in range(args.repeats):
                run, (kind, _, arg) = workload, workload.partition("=")
                threshold = 1.0 if kind == "full" else float(arg) if kind == "threshold" else None
                if kind == "depth":
                    # Each repeat has its own prompts (seed = rep), and with the real gate the depth a threshold
                    # gives varies by prompt: found per repeat, so that every repeat runs at the target depth.
                    threshold, depth = threshold_for_depth(
                        engine, float(arg), args.input_len, args.output_len, c, args.calibration_requests or n, seed=rep
                    )
                    log.info("%s c=%d rep %d: threshold %.4f gives mean depth %.2f", workload, c, rep, threshold, depth)
                    run = f"threshold={threshold}"
                r = run_closed_loop(
                    engine,
                    args.input_len,
                    args.output_len,
                    c,
                    n,
                    run,
                    seed=rep,
                    arrival_rate=rates[c],
                    ignore_eos=not args.natural_eos,
                    min_output_len=args.min_output_len,
                )
                r["threshold"] = threshold
                log.info(
                    "%s c=%d rep %d: %.1f output tok/s, mean depth %s",
                    workload,
                    c,
                    rep,
                    r["output_tok_s"],
                    r["mean_exit_depth"],
                )
                reps.append(r)
            results["runs"].append(
                dict(workload=workload, concurrency=c, num_requests=n, median=median_of(reps), repeats=reps)
            )
    # Gated runs against the full-depth run of the same concurrency (same requests, same prompts per repeat).
    T = engine.model_config.num_loops
    prompt_s = args.input_len * T * 2 * loop_params(engine) / PROMPT_FLOPS
    for run in results["runs"]:
        full = next(
            (f for f in results["runs"] if f["workload"] == "full" and f["concurrency"] == run["concurrency"]), None
        )
        # (Open loop: the arrivals set the wall time, so there is no speed-up to compare.)
        if (
            full is not None
            and run is not full
            and run["median"]["mean_exit_depth"]
            and rates[run["concurrency"]] is None
        ):
            run["median"].update(loop_metrics(run["median"], full["median"], T, prompt_s * run["num_requests"]))
    print_table(results)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


def print_table(results: dict) -> None:
    fmt = lambda x, f="{:.0f}": "-" if x is None else f.format(x)  # noqa: E731
    print(f"\n{results['label']}  in {results['input_len']} / out {results['output_len']}  on {results['device']}")
    print(
        f"{'workload':<17}{'conc':>5}{'out tok/s':>11}{'prefill':>10}{'decode':>9}{'steady':>9}"
        f"{'TTFT p50':>10}{'TPOT p50':>10}{'depth':>7}{'KV':>6}{'graph/eager':>13}{'rnd/tok':>8}{'sync/tok':>9}"
        f"{'GPU idle':>9}{'occup':>7}{'tail':>6}{'accept':>8}"
    )
    for run in results["runs"]:
        m = run["median"]
        print(
            f"{run['workload']:<17}{run['concurrency']:>5}{fmt(m['output_tok_s']):>11}{fmt(m['prefill_tok_s']):>10}"
            f"{fmt(m['decode_tok_s']):>9}{fmt(m['steady_decode_tok_s']):>9}"
            f"{fmt(m['ttft_s'].get('p50', 0) * 1e3, '{:.1f}ms'):>10}"
            f"{fmt(m['tpot_s'].get('p50', 0) * 1e3, '{:.2f}ms'):>10}"
            f"{fmt(m['mean_exit_depth'], '{:.2f}'):>7}{fmt(m['peak_kv_usage'] * 100, '{:.0f}%'):>6}"
            f"{m['graph_launches']:>7.0f}/{m['eager_launches']:<5.0f}{m['rounds_per_token']:>8.2f}"
            f"{m['host_syncs_per_token']:>9.3f}{fmt(m['gpu_idle_frac'] and m['gpu_idle_frac'] * 100, '{:.0f}%'):>9}"
            f"{fmt(m['decode_occupancy'], '{:.2f}'):>7}{fmt(m['tail_frac'] * 100, '{:.0f}%'):>6}"
            f"{fmt(None if m.get('spec_acceptance') is None else m['spec_acceptance'] * 100, '{:.0f}%'):>8}"
        )
    print(f"\n{'workload':<17}{'conc':>5}{'vs full':>9}{'ideal':>7}{'effic':>7}{'TTFT p99':>10}   device time by kind")
    for run in results["runs"]:
        m = run["median"]
        kinds = "  ".join(
            f"{kind} {k['rounds']:.0f}r {1e3 * k['gpu_s']:.0f}ms"
            for kind, k in m["gpu_s_by_launch"].items()
            if k["rounds"]
        )
        print(
            f"{run['workload']:<17}{run['concurrency']:>5}{fmt(m.get('ratio_vs_full'), '{:.2f}x'):>9}"
            f"{fmt(m.get('loop_ideal_ratio'), '{:.2f}'):>7}{fmt(m.get('loop_efficiency'), '{:.2f}'):>7}"
            f"{fmt(m['ttft_s'].get('p99', 0) * 1e3, '{:.1f}ms'):>10}   {kinds or '-'}"
        )
    for b in results["baseline"]:
        print(
            f"{'baseline(eager)':<17}{b['batch']:>5}{b['output_tok_s']:>11.1f}{b['prefill_tok_s']:>10.0f}"
            f"{b['decode_tok_s']:>9.1f}   (HF-style eager, concatenated per-loop cache, {b['tokens']} tokens)"
        )


if __name__ == "__main__":
    sys.exit(main())
