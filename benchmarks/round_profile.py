"""Kernel-level profile of one decode round and one prompt round (captured graphs replayed alone), to say
where a round's time goes against the weight-read floor.

Ouro-1.4B shape (random bf16 weights), default engine options. For decode graphs of 1 and 64 rows (one
round, greedy) and the prompt graph of 128 tokens: the replay's median time (50 replays), then the GPU
kernels of 5 replays under torch.profiler, grouped by kind (GEMM, attention, norm, rope/KV write,
state machine, the rest). The floor is the bytes of one loop's weights over the HBM bandwidth given.
`round_ms_by_rows` is the replay time of every decode row bucket's one-round graph: what a round costs as
a function of its rows (with the capture's attention lengths, not a run's), which with ouro-bench's
`ideal_rounds` says how much a drained round saves.

``--prompt-tokens N`` profiles instead one fresh N-token prompt end to end (all four loops, max_tokens 1, the
engine's own steps: eager above `cuda_graph_max_tokens`), after one unprofiled warm-up prompt: its wall time
(and `wall_ms_unprofiled`, the median of three fresh prompts timed without the profiler),
the GPU kernels by kind and the top kernels, with the GEMMs' and attention's TFLOP/s against ``--bf16-tflops``
(what holds a prompt chunk below its share of peak FLOP/s), and the attention launches grouped by grid
(`attention_launches`: the chunk's own launches apart from the decode rows' beside them).

    python3 benchmarks/round_profile.py [--out FILE.json] [--hbm-tb-s 4.8]
    python3 benchmarks/round_profile.py --prompt-tokens 2048 [--out FILE.json]
    python3 benchmarks/round_profile.py --prompt-tokens 2048 --busy 16 [--steps 12] [--out FILE.json]

``--busy C`` profiles a running engine instead (`busy_profile`): C such prompts at once, a window of steps timed
by the launch timer alone and one under the profiler too.
"""

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.graph_timing import replay_ms
from benchmarks.prompt_work import fresh_prompt_ms, prompt_flops
from ouro_backend import EngineConfig, LLMEngine, SamplingParams
from ouro_backend.entrypoints.bench import ensure_shape_checkpoint, gpu_by_launch
from ouro_backend.model.sampler import SamplerMode

KINDS = [
    ("gemm", ("gemm", "gemv", "cutlass", "sm90", "nvjet", "matmul", "splitk", "sgemm")),
    ("attention", ("attn", "flash", "paged")),
    ("norm", ("norm",)),
    ("rope/kv", ("rope", "kv", "cache")),
    ("state machine", ("prepare", "advance", "decode_step", "emit")),
    ("activation", ("silu", "act", "mul")),
    ("sampling/argmax", ("argmax", "sampl", "max")),
    ("copy/index", ("copy", "index", "gather", "scatter", "cat")),
]


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def kernels(graph, n: int = 5) -> dict:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            graph.replay()
        torch.cuda.synchronize()
    return summarize(prof, n)


def summarize(prof, n: int, top_n: int = 12) -> dict:
    """A profile's CUDA kernels, per replay of n: us by kind, counts by kind, the top_n kernels by us."""
    by_kind, count = defaultdict(float), defaultdict(int)
    top = defaultdict(float)
    for ev in prof.events():
        if ev.device_type.name != "CUDA":
            continue
        us = ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
        by_kind[kind_of(ev.name)] += us / n
        count[kind_of(ev.name)] += 1
        top[ev.name[:80]] += us / n
    return dict(
        kernel_us_by_kind={k: round(v, 1) for k, v in sorted(by_kind.items(), key=lambda x: -x[1])},
        kernels_per_replay={k: c // n for k, c in count.items()},
        top_kernels_us={k: round(v, 1) for k, v in sorted(top.items(), key=lambda x: -x[1])[:top_n]},
    )


def launches_by_grid(trace: dict, kind: str) -> list[dict]:
    """The kernel launches of one kind in a torch.profiler chrome trace (`export_chrome_trace`'s JSON), grouped by
    kernel name and grid: one kernel's launches of different shapes (a prompt chunk's attention and the decode
    rows' beside it) are told apart. Each group: name, grid, launches, total us, median us; longest first."""
    groups: dict[tuple[str, tuple[int, ...]], list[float]] = defaultdict(list)
    for ev in trace.get("traceEvents", []):
        if ev.get("cat") != "kernel" or kind_of(ev.get("name", "")) != kind:
            continue
        grid = tuple(ev.get("args", {}).get("grid", ()))
        groups[(ev["name"][:80], grid)].append(float(ev.get("dur", 0.0)))
    out = [
        dict(
            name=name,
            grid=list(grid),
            launches=len(d),
            total_us=round(sum(d), 1),
            median_us=round(statistics.median(d), 2),
        )
        for (name, grid), d in groups.items()
    ]
    return sorted(out, key=lambda g: -g["total_us"])


def attention_launches(prof) -> list[dict]:
    """A finished profile's attention launches grouped by grid (`launches_by_grid`, from its chrome trace)."""
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(os.path.join(tmp, "trace.json"))
        with open(os.path.join(tmp, "trace.json")) as f:
            return launches_by_grid(json.load(f), "attention")


def prompt_profile(eng: LLMEngine, tokens: int, peak_tflops: float) -> dict:
    """One fresh prompt of ``tokens`` tokens through the engine's own steps (max_tokens 1), profiled after an
    unprofiled one of the same length (compiles, sizes the eager path)."""
    rng = random.Random(time.time_ns())
    fresh_prompt_ms(eng, tokens, rng, "warm-up")
    plain = [fresh_prompt_ms(eng, tokens, rng, f"plain{i}") for i in range(3)]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        wall_ms = fresh_prompt_ms(eng, tokens, rng, "profiled")
    rep = dict(
        prompt_tokens=tokens,
        wall_ms=round(wall_ms, 3),
        wall_ms_unprofiled=round(statistics.median(plain), 3),
        **summarize(prof, 1, top_n=25),
    )
    rep["attention_launches"] = attention_launches(prof)
    gemm_flops, attn_flops = prompt_flops(eng, tokens)
    us = rep["kernel_us_by_kind"]
    for kind, flops in (("gemm", gemm_flops), ("attention", attn_flops)):
        if us.get(kind):
            tf = flops / (us[kind] * 1e-6) / 1e12
            rep[f"{kind}_tflops"] = round(tf, 1)
            rep[f"{kind}_pct_of_peak"] = round(100 * tf / peak_tflops, 1)
    rep["kernel_ms"] = round(sum(us.values()) / 1e3, 3)
    rep["all_tflops"] = round((gemm_flops + attn_flops) / (wall_ms * 1e-3) / 1e12, 1)
    return rep


def busy_profile(eng: LLMEngine, tokens: int, concurrency: int, steps: int) -> dict:
    """A running engine: ``concurrency`` fresh prompts of ``tokens`` tokens (64 output tokens each) added at once,
    8 steps to fill it, then ``steps`` steps with the launch timer on (each launch's device time from CUDA events,
    by kind of launch as ouro-bench reports it: `gpu_by_launch`), then ``steps`` more under torch.profiler as
    well; the requests are aborted after.
    Tells whether a kernel times the same inside running rounds as in a lone prompt's."""
    rng = random.Random(time.time_ns())
    vocab = eng.runner.model.cfg.vocab_size
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for i in range(concurrency):
        eng.add_request(f"busy{i}", [rng.randrange(3, vocab) for _ in range(tokens)], params)
    for _ in range(8):
        eng.step()
    timer = eng.runner.timer

    def window(label: str) -> dict:
        timer.enabled = True
        timer.take()
        t = time.perf_counter()
        for _ in range(steps):
            eng.step()
        wall = time.perf_counter() - t
        _, busy, launches = timer.take()
        timer.enabled = False
        by_kind = {kind: k for kind, k in gpu_by_launch(launches).items() if k["launches"]}
        ms = {"wall_ms": round(wall * 1e3, 2), "busy_ms": round(busy * 1e3, 2), "by_kind": by_kind}
        return {f"{label}_{k}": v for k, v in ms.items()}

    rep: dict = dict(prompt_tokens=tokens, concurrency=concurrency, steps=steps, **window("plain"))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        rep.update(window("profiled"))
    rep.update(summarize(prof, 1, top_n=15))
    rep["attention_launches"] = attention_launches(prof)
    for i in range(concurrency):
        eng.abort_request(f"busy{i}")
    while eng.get_num_unfinished_requests():
        eng.step()
    return rep


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--hbm-tb-s", type=float, default=4.8)
    ap.add_argument("--bf16-tflops", type=float, default=990.0)
    ap.add_argument("--prompt-tokens", type=int, default=0, help="profile one fresh prompt of N tokens instead")
    ap.add_argument("--busy", type=int, default=0, help="with --prompt-tokens: C such prompts at once (busy_profile)")
    ap.add_argument("--steps", type=int, default=12, help="--busy: steps a window")
    args = ap.parse_args()
    eng = LLMEngine(EngineConfig.from_strings({"model": ensure_shape_checkpoint("ouro-1.4b")}))
    if args.prompt_tokens:
        if args.busy:
            rep = busy_profile(eng, args.prompt_tokens, args.busy, args.steps)
        else:
            rep = prompt_profile(eng, args.prompt_tokens, args.bf16_tflops)
        print(json.dumps(rep, indent=1))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(rep, f, indent=1)
        return
    r, m = eng.runner, eng.runner.model
    loop_bytes = sum(t.numel() * t.element_size() for layer in m.layers for t in vars(layer).values())
    head_bytes = m.lm_head.numel() * m.lm_head.element_size()
    report = dict(
        loop_weight_bytes=loop_bytes,
        floor_loop_ms=loop_bytes / args.hbm_tb_s / 1e9,
        lm_head_bytes=head_bytes,
        floor_lm_head_ms=head_bytes / args.hbm_tb_s / 1e9,
        graphs={},
    )
    picks = [(f"decode {b} rows", r.graphs.decode[(b, 1, SamplerMode.GREEDY)]) for b in (1, 64)]
    picks += [
        (f"prompt 128 tokens beside {d} rows", g)
        for (d, t, mode), g in sorted(r.graphs.mixed.items(), key=lambda kv: kv[0][:2])
        if t == 128 and mode == SamplerMode.GREEDY
    ]
    ones = {b: g for (b, rounds, mode), g in r.graphs.decode.items() if rounds == 1 and mode == SamplerMode.GREEDY}
    report["round_ms_by_rows"] = {b: round(replay_ms(ones[b].graph, 50, 5), 4) for b in sorted(ones)}
    print("round ms by rows", report["round_ms_by_rows"])
    for name, g in picks:
        report["graphs"][name] = dict(replay_ms=replay_ms(g.graph, 50, 5), **kernels(g.graph))
        print(name, json.dumps(report["graphs"][name], indent=1))
    print(
        f"floor: one loop's weights {loop_bytes / 1e9:.2f} GB -> {report['floor_loop_ms']:.3f} ms; "
        f"LM head {report['floor_lm_head_ms']:.3f} ms"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
