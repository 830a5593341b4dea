"""Self-speculation served vs engine-direct at concurrency 1, in one run, on distinct prompts.

Four phases on the same checkpoint and the same text prompts (one request at a time, greedy, EOS ignored,
each phase's GPU memory gone before the next starts):

1. engine-direct, plain decoding, then with speculation (`--spec-arg`): `LLMEngine` in a subprocess;
2. served, plain, then with speculation: `ouro-serve` with the same engine options, every prompt streamed
   through `ouro` over gRPC; after the speculative server's run, its metrics port is scraped for
   `ouro_spec_*`.

Reported: output tok/s of each phase (median of --repeats passes over the prompts, first-token time and tail
included), the direct and served speedups and their ratio, whether the served texts with speculation equal
the plain ones (and the direct token ids), and the acceptance both from the engine and from the metrics.

    python benchmarks/served_spec.py --loop-change 0.015 --spec-arg spec_tokens=6 --spec-arg spec_draft_loops=1
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.served import make_prompt, wait_ready  # noqa: E402


def direct_phase(args) -> None:
    """Engine-direct: each prompt alone, in order, --repeats passes; prints one JSON line."""
    from ouro_backend import EngineConfig, LLMEngine, SamplingParams

    prompts = json.loads(Path(args.prompts_file).read_text())
    opts = dict(kv.split("=", 1) for kv in args.engine_arg)
    engine = LLMEngine(EngineConfig.from_strings({**opts, "model": args.model}))
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)

    def one(rid: str, ids: list[int]) -> list[int]:
        engine.add_request(rid, ids, params)
        while True:
            for o in engine.step():
                if o.finished:
                    return list(o.token_ids)

    one("warmup", prompts[0]["ids"])
    passes, tokens = [], None
    stats0 = engine.stats()
    for rep in range(args.repeats):
        t0 = time.perf_counter()
        outs = [one(f"p{rep}-{i}", p["ids"]) for i, p in enumerate(prompts)]
        wall = time.perf_counter() - t0
        passes.append(sum(map(len, outs)) / wall)
        tokens = outs
    stats = engine.stats()
    drafted = stats["spec_drafted"] - stats0["spec_drafted"]
    accepted = stats["spec_accepted"] - stats0["spec_accepted"]
    print(
        json.dumps(
            dict(
                output_tok_s=statistics.median(passes),
                passes_tok_s=passes,
                token_ids=tokens,
                acceptance=accepted / drafted if drafted else None,
                spec_drafted=drafted,
                eager_launches=stats["eager_launches"] - stats0["eager_launches"],
                graph_launches=stats["graph_launches"] - stats0["graph_launches"],
            )
        )
    )


def run_direct(args, engine_args: list[str]) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--direct-phase",
        "--model",
        args.model,
        "--prompts-file",
        args.prompts_file,
        "--output-len",
        str(args.output_len),
        "--repeats",
        str(args.repeats),
        *[a for kv in engine_args for a in ("--engine-arg", kv)],
    ]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"direct phase failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def scrape_spec_metrics(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://localhost:{port}/metrics", timeout=10).read().decode()
    found = {}
    for line in text.splitlines():
        if line.startswith("ouro_spec_"):
            name, value = line.rsplit(" ", 1)
            found[name] = float(value)
    return found


def run_served(args, engine_args: list[str], out: Path, label: str) -> dict:
    from client.ouro_client import generate, request_options

    prompts = json.loads(Path(args.prompts_file).read_text())
    http_port, grpc_port, metrics_port = args.port_base, args.port_base + 1, args.port_base + 2
    cmd = [
        sys.executable,
        "-m",
        "ouro_backend.entrypoints.serve",
        "--model",
        args.model,
        "--http-port",
        str(http_port),
        "--grpc-port",
        str(grpc_port),
        "--metrics-port",
        str(metrics_port),
        "--log-file",
        str(out / f"tritonserver_{label}.log"),
        *[a for kv in engine_args for a in ("--engine-arg", kv)],
    ]
    server = subprocess.Popen(
        cmd, stdout=open(out / f"ouro-serve_{label}.out", "w"), stderr=subprocess.STDOUT, start_new_session=True
    )
    url = f"localhost:{grpc_port}"
    options = request_options(
        max_tokens=args.output_len, ignore_eos=True, temperature=0.0, return_num_output_tokens=True
    )
    try:
        wait_ready(url, "ouro", 900, server)
        warm = generate(url, "ouro", prompts[0]["text"], options)
        if warm.error:
            raise SystemExit(f"served warm-up failed: {warm.error}")
        passes, texts = [], None
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            results = [generate(url, "ouro", p["text"], options) for p in prompts]
            wall = time.perf_counter() - t0
            errors = [r.error for r in results if r.error]
            if errors:
                raise SystemExit(f"served request failed: {errors[0]}")
            passes.append(sum(r.num_tokens for r in results) / wall)
            texts = [r.text for r in results]
        metrics = scrape_spec_metrics(metrics_port)
    finally:
        os.killpg(server.pid, signal.SIGINT)
        server.wait(timeout=120)
    return dict(output_tok_s=statistics.median(passes), passes_tok_s=passes, texts=texts, metrics=metrics)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="ouro-1.4b")
    p.add_argument("--loop-change", type=float, default=0.015)
    p.add_argument("--model", default=None, help="checkpoint (default: the random --shape at --loop-change)")
    p.add_argument("--prompts", type=int, default=8, help="distinct prompts, each run alone")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--engine-arg", action="append", default=[], help="for every phase")
    p.add_argument("--spec-arg", action="append", default=[], help="for the speculative phases")
    p.add_argument("--port-base", type=int, default=18100)
    p.add_argument("--out", default="served-spec-results")
    p.add_argument("--direct-phase", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--prompts-file", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.direct_phase:
        direct_phase(args)
        return 0

    from ouro_backend.entrypoints.bench import ensure_shape_checkpoint

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.model_given = args.model is not None
    args.model = args.model or ensure_shape_checkpoint(args.shape, args.loop_change)
    prompts = []
    for seed in range(args.prompts):
        text, ids = make_prompt(args.model, args.input_len, seed=seed)
        prompts.append(dict(text=text, ids=ids))
    args.prompts_file = str(out / "prompts.json")
    Path(args.prompts_file).write_text(json.dumps(prompts))
    plain_args, spec_args = list(args.engine_arg), args.engine_arg + args.spec_arg

    phases = {}
    for label, engine_args in (("plain", plain_args), ("spec", spec_args)):
        phases[f"direct_{label}"] = run_direct(args, engine_args)
        print(f"direct {label}: {phases[f'direct_{label}']['passes_tok_s']} output tok/s", flush=True)
    for label, engine_args in (("plain", plain_args), ("spec", spec_args)):
        phases[f"served_{label}"] = run_served(args, engine_args, out, label)
        print(f"served {label}: {phases[f'served_{label}']['passes_tok_s']} output tok/s", flush=True)
    (out / "phases.json").write_text(json.dumps(phases, indent=1))

    dp, ds_, sp, ss = (phases[k] for k in ("direct_plain", "direct_spec", "served_plain", "served_spec"))
    direct_speedup = ds_["output_tok_s"] / dp["output_tok_s"]
    served_speedup = ss["output_tok_s"] / sp["output_tok_s"]
    summary = dict(
        command=" ".join([os.path.relpath(__file__, ROOT)] + sys.argv[1:]),
        model=args.model,
        loop_change=None if args.model_given else args.loop_change,
        concurrency=1,
        prompts=args.prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        engine_args=plain_args,
        spec_args=args.spec_arg,
        direct_plain_tok_s=dp["output_tok_s"],
        direct_spec_tok_s=ds_["output_tok_s"],
        served_plain_tok_s=sp["output_tok_s"],
        served_spec_tok_s=ss["output_tok_s"],
        direct_speedup=direct_speedup,
        served_speedup=served_speedup,
        served_vs_direct_speedup=served_speedup / direct_speedup,
        direct_acceptance=ds_["acceptance"],
        direct_spec_eager_launches=ds_["eager_launches"],
        metrics=ss["metrics"],
        direct_tokens_identical=dp["token_ids"] == ds_["token_ids"],
        served_texts_identical=sp["texts"] == ss["texts"],
    )
    (out / "served_spec_summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return 0 if summary["direct_tokens_identical"] and summary["served_texts_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
