"""Where the GPU's time goes, per kind of launch, without adding syncs.

A CUDA event is recorded at the start of every launched round; the GPU time of a round is the time to the
next round's start event (with asynchronous scheduling the GPU runs rounds back to back, so this is the
round's device time plus any idle gap the host left before the next one), next to the host time of the
launch call itself. Rounds are grouped into
decode graph / prompt graph (prompt chunks, captured) / eager (prompt chunks above cuda_graph_max_tokens).
Closed loop, Ouro-1.4B shape, c=64, 128 in / 64 out, 128 requests after a warm-up of the same size.
Also times each decode graph replayed alone (median of 50), the floor of a decode round.

    python3 benchmarks/round_anatomy.py [--out FILE.json] [--engine-arg KEY=VALUE ...] [workload ...]
"""

import argparse
import json
import statistics
import time
from collections import defaultdict

import torch

from ouro_backend import EngineConfig, LLMEngine
from ouro_backend.entrypoints.bench import ensure_shape_checkpoint, run_closed_loop

ap = argparse.ArgumentParser()
ap.add_argument("workloads", nargs="*", default=["full", "trace=2.5"])
ap.add_argument("--out")
ap.add_argument("--engine-arg", action="append", default=[])
args = ap.parse_args()
options = dict(kv.split("=", 1) for kv in args.engine_arg)
options.setdefault("exit_mode", "trace")
if "model" not in options:
    options["model"] = ensure_shape_checkpoint("ouro-1.4b")
eng = LLMEngine(EngineConfig.from_strings(options))
r = eng.runner

alone = {}
for key, g in sorted(r.graphs.decode.items()):
    ts = []
    for i in range(55):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.graph.replay()
        e.record()
        e.synchronize()
        if i >= 5:
            ts.append(s.elapsed_time(e))
    alone[f"{key[0]} rows x {key[1]} rounds, {key[2].name.lower()}"] = statistics.median(ts)
print("decode graph replay alone (ms):", {k: round(v, 3) for k, v in alone.items()})

starts: list[tuple[torch.cuda.Event, str, dict]] = []
launch = r.launch


def timed_launch(plan):
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    graphs = r.stats.graph_launches
    t0 = time.perf_counter()
    rnd = launch(plan)
    st = dict(r.last_round, host_ms=(time.perf_counter() - t0) * 1e3)
    kind = (
        ("decode graph" if not st["prefill_tokens"] else "prompt graph") if r.stats.graph_launches > graphs else "eager"
    )
    starts.append((ev, kind, st))
    return rnd


r.launch = timed_launch
report = {"decode_graph_alone_ms": alone, "options": options}
for w in args.workloads:
    run_closed_loop(eng, 128, 64, 64, 128, w, seed=1)  # warm-up: compiles every kernel variant it meets
    starts.clear()
    res = run_closed_loop(eng, 128, 64, 64, 128, w)
    end = torch.cuda.Event(enable_timing=True)
    end.record()
    end.synchronize()
    groups = defaultdict(
        lambda: dict(rounds=0, ms=0.0, launch_host_ms=0.0, prompt_tokens=0, decode_rows=0, decode_rounds=0)
    )
    marks = [s[0] for s in starts] + [end]
    for (ev, kind, st), nxt in zip(starts, marks[1:]):
        g = groups[kind]
        g["rounds"] += 1
        g["ms"] += ev.elapsed_time(nxt)
        g["launch_host_ms"] += st["host_ms"]
        g["prompt_tokens"] += st["prefill_tokens"]
        g["decode_rows"] += st["decode_rows"]
        g["decode_rounds"] += st["rounds"] if st["decode_rows"] else 0
    print(
        f"== {w}: {res['output_tok_s']:.0f} tok/s, wall {res['wall_s'] * 1e3:.0f} ms, "
        f"GPU span {marks[0].elapsed_time(end):.0f} ms, {res['launches']} launches, {res['rounds']} rounds"
    )
    print(
        f"   {'kind':<14}{'rounds':>7}{'total ms':>10}{'ms/round':>10}{'launch host':>12}"
        f"{'prompt tok':>12}{'decode rows':>13}{'rounds':>9}"
    )
    for kind, g in sorted(groups.items()):
        n = g["rounds"]
        print(
            f"   {kind:<14}{n:>7}{g['ms']:>10.1f}{g['ms'] / n:>10.3f}{g['launch_host_ms'] / n:>12.3f}"
            f"{g['prompt_tokens'] / n:>12.1f}"
            f"{g['decode_rows'] / n:>13.1f}{g['decode_rounds'] / n:>9.1f}"
        )
    report[w] = dict(result=res, groups=dict(groups))
if args.out:
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1, default=str)
