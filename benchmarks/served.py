"""Served vs engine-direct, side by side in one run: the same prompt, output length and concurrency,
greedy, EOS ignored, full depth (or the gate with --exit-threshold).

1. engine-direct: `ouro_backend.entrypoints.bench.run_closed_loop` in a subprocess (its GPU memory is gone when the
   server starts), median of --repeats;
2. served: `ouro-serve` on the same checkpoint, then `client/load.py` (gRPC streaming, closed loop)
   against `ouro` (median of --repeats) and perf_analyzer (`-i grpc --streaming`) against `ouro`, both
   with the same prompt and a stream per worker kept open across requests; with --genai-perf also
   genai-perf (client/genai_perf/run_genai_perf.py: synthetic prompts of --input-len tokens, the same
   concurrency, output length and request count), so the three tools measure one server.

With --stand-in the model is replaced (benchmarks/stand_in_engine.py: a launch costs nothing, or
--stand-in-round-ms, and each running request gets a token per launch), so the run measures the serving
path alone: the engine process's bookkeeping, the socket and protocol, the front, detokenization, Triton's
stubs and the client; there is no engine-direct side then.

With --trace the served engine records its rounds (ouro_backend/engine/round_trace.py): a
served run that falls behind engine-direct shows whether the engine was slower per round or had fewer
requests running; and every request's hops through the server are timed
(ouro_backend/serving/request_trace.py), which says where served TTFT goes.

    python benchmarks/served.py --shape ouro-1.4b --concurrency 64 --out results/
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def make_prompts(model: str, length: int, count: int, seed: int = 0) -> list[tuple[str, list[int]]]:
    """`count` distinct text prompts of about `length` tokens each (random ids decoded, re-encoded); prompt i
    comes from seed `seed + i`, so runs that take different seed ranges never share a prompt."""
    from ouro_backend.model.tokenizer import load_tokenizer

    tok = load_tokenizer(model)
    out = []
    for i in range(count):
        rng = random.Random(seed + i)
        ids = [rng.randrange(3, tok.get_vocab_size()) for _ in range(length)]
        # Decoding and re-encoding random ids yields more tokens: trim until the text is `length` tokens or less.
        n = length
        while True:
            # perf_analyzer reads its input data's strings up to the first NUL: a prompt must have none
            text = tok.decode(ids[:n]).replace("\x00", "")
            enc = tok.encode(text, add_special_tokens=False).ids
            if len(enc) <= length:
                out.append((text, enc))
                break
            n -= max(1, (len(enc) - length) // 2)
    return out


def make_prompt(model: str, length: int, seed: int = 0) -> tuple[str, list[int]]:
    """One prompt of `make_prompts`."""
    return make_prompts(model, length, 1, seed)[0]


DEPTH_SEARCH_RUNS = 6  # --depth: untimed runs of the bisection


def prompt_plan(model: str, args) -> dict:
    """Every request's prompt, each seed range its own, so that within an engine no two requests share one
    and no timed run is served from a prefix cache:
    - "served": per served model, the warm-up's then each repeat's texts (through load.py);
    - "direct": engine-direct's token ids unless --skip-direct / --stand-in: the untimed --depth search's of
      their own seeds, then with --direct-prompts served (the default) the ids of the first served model's
      repeat i for direct repeat i. Engine-direct and the server are two engines (two processes, two prefix
      caches), so each still prefills every prompt once; the gate's depth depends on the prompts, so both
      sides run the same tokens at the same depth and the ratio compares the same work. --direct-prompts own
      gives engine-direct prompts no served request uses;
    - "process": the --process loop's ids (its own engine), else None;
    - "perf_analyzer": its input data's texts (sent in turn), else None;
    - "prompt_tokens": the served prompts' mean length."""
    n, phases = args.requests, args.repeats + 1

    def prompts(count: int, seed: int) -> list[tuple[str, list[int]]]:
        return make_prompts(model, args.input_len, count, seed=seed)

    served_prompts = prompts(phases * n * len(args.models), 1_000_000)
    served = {
        name: [[t for t, _ in served_prompts[(m * phases + i) * n : (m * phases + i + 1) * n]] for i in range(phases)]
        for m, name in enumerate(args.models)
    }
    direct = None
    if not (args.skip_direct or args.stand_in):
        search = DEPTH_SEARCH_RUNS * n if args.depth else 0
        own = args.repeats * n if args.direct_prompts == "own" else 0
        direct = [ids for _, ids in prompts(search + own, 3_000_000)]
        if args.direct_prompts == "served":
            direct += [ids for _, ids in served_prompts[n : phases * n]]  # model 0's repeats
    return dict(
        served=served,
        direct=direct,
        process=[ids for _, ids in prompts(phases * n, 0)] if args.process else None,
        perf_analyzer=None
        if args.skip_perf_analyzer
        else [t for t, _ in prompts(args.perf_analyzer_prompts, 2_000_000)],
        prompt_tokens=statistics.mean(len(ids) for _, ids in served_prompts),
    )


def direct(args) -> None:
    from ouro_backend import EngineConfig, LLMEngine, SamplingParams
    from ouro_backend.entrypoints.bench import median_of, run_closed_loop, threshold_for_depth

    eng = LLMEngine(EngineConfig(model=args.model, max_num_seqs=args.concurrency))
    warm = random.Random(-1)
    eng.add_request(
        "warmup", [warm.randrange(3, eng.model_config.vocab_size) for _ in range(args.input_len)],
        SamplingParams(max_tokens=4, ignore_eos=True),
    )  # fmt: skip
    while eng.has_unfinished_requests():
        eng.step()
    # Prompts made as the served side's are (make_prompts: texts re-encoded; the gate's depth depends on
    # them), distinct for every request of every repeat and of the depth search, and the prefix cache is
    # emptied before each run (run_closed_loop): nothing is prefilled twice.
    prompts: list[list[int]] = json.loads(Path(args.prompt_ids).read_text())
    n = args.requests
    threshold = args.exit_threshold
    if args.depth:  # untimed runs on the first prompts
        search, prompts = prompts[: DEPTH_SEARCH_RUNS * n], prompts[DEPTH_SEARCH_RUNS * n :]
        threshold, _ = threshold_for_depth(
            eng, args.depth, args.input_len, args.output_len, args.concurrency, n, iters=DEPTH_SEARCH_RUNS,
            prompts=search,
        )  # fmt: skip
    workload = "full" if threshold >= 1 else f"threshold={threshold}"

    reps = [
        run_closed_loop(
            eng, args.input_len, args.output_len, args.concurrency, n, workload, prompts=prompts[i * n : (i + 1) * n]
        )
        for i in range(args.repeats)
    ]
    for r in reps:
        r["threshold"] = threshold
    print(json.dumps(dict(median=median_of(reps), repeats=reps)), flush=True)
    # Free the engine (graphs, pinned staging buffers) here, while CUDA is up, not at the interpreter's exit.
    del eng
    gc.collect()


def process_loop(args) -> None:
    """The same closed loop through the engine process, from a plain Python client on its owner channel:
    what the process boundary costs without Triton."""
    import queue
    import tempfile

    from ouro_backend import EngineConfig, SamplingParams
    from ouro_backend.entrypoints.bench import median_of, percentiles
    from ouro_backend.serving.engine_client import start_engine_process
    from ouro_backend.serving.engine_messages import Failed, FromEngine, Outputs, Rejected

    prompts: list[list[int]] = json.loads(Path(args.prompt_ids).read_text())  # one per request, never reused
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, exit_threshold=args.exit_threshold)
    finished: queue.Queue[str] = queue.Queue()
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    tokens: dict[str, int] = {}

    errors: list[str] = []

    def on_message(msg: FromEngine) -> None:
        if isinstance(msg, (Rejected, Failed)):
            errors.append(f"{type(msg).__name__}: {msg.message}")
            finished.put("")
            return
        if not isinstance(msg, Outputs):
            return
        now = time.perf_counter()
        for d in msg.deltas:
            first.setdefault(d.rid, now)
            tokens[d.rid] = tokens.get(d.rid, 0) + len(d.ids)
            if d.finish_reason:
                last[d.rid] = now
                finished.put(d.rid)

    address = os.path.join(tempfile.mkdtemp(prefix="ouro-bench-"), "engine.sock")
    client, proc = start_engine_process(
        EngineConfig(model=args.model, max_num_seqs=args.concurrency), address, on_message, lambda: None
    )
    try:
        reps = []
        for rep in range(args.repeats + 1):  # the first one warms up
            sent: dict[str, float] = {}

            def submit() -> None:
                rid = f"r{rep}-{len(sent)}"
                sent[rid] = time.perf_counter()
                client.add(rid, prompts[rep * args.requests + len(sent) - 1], params)

            t0 = time.perf_counter()
            for _ in range(min(args.concurrency, args.requests)):
                submit()
            for _ in range(args.requests):
                finished.get(timeout=600)
                if errors:
                    raise SystemExit(f"--process: the engine process {errors[0]}")
                if len(sent) < args.requests:
                    submit()
            wall = time.perf_counter() - t0
            gen = sum(tokens[r] for r in sent)
            reps.append(
                dict(
                    output_tok_s=gen / wall,
                    wall_s=wall,
                    ttft_s=percentiles([first[r] - sent[r] for r in sent]),
                    tpot_s=percentiles([(last[r] - first[r]) / (tokens[r] - 1) for r in sent if tokens[r] > 1]),
                )
            )
        reps = reps[1:]
    finally:
        client.close()
        proc.wait(timeout=60)
    print(json.dumps(dict(median=median_of(reps), repeats=reps)))


def server_cpu_seconds(root: int) -> dict[str, float]:
    """CPU seconds used so far by process `root` (ouro-serve) and its descendants (the tritonserver, each
    model's Python stubs, the engine processes), summed by role."""
    from ouro_backend.entrypoints.procfs import cpu_seconds, descendants, process_argv, stub_model

    out: dict[str, float] = {}
    for pid in descendants(root):
        argv, cpu = process_argv(pid) or [b""], cpu_seconds(pid)
        if cpu is None:
            continue
        model = stub_model(argv)
        if model is not None:
            role = f"stub:{model}"
        elif any(b"engine_server" in a for a in argv):
            role = "engine_process"
        else:
            role = "ouro-serve" if pid == root else os.path.basename(argv[0].decode(errors="replace")) or "?"
        out[role] = out.get(role, 0.0) + cpu
    return out


def wait_ready(url: str, model: str, timeout: float, proc: subprocess.Popen) -> None:
    import tritonclient.grpc as grpc

    client = grpc.InferenceServerClient(url)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"ouro-serve exited with {proc.returncode}")
        try:
            if client.is_model_ready(model):
                return
        except Exception:
            pass
        time.sleep(1)
    raise TimeoutError("server not ready")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="ouro-1.4b")
    p.add_argument("--model", default=None)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--port-base", type=int, default=18000)
    p.add_argument("--engine-arg", action="append", default=[])
    p.add_argument(
        "--model-repository",
        default=None,
        help="serve this model repository (ouro-serve --model-repository), e.g. one with other front options",
    )
    p.add_argument("--skip-perf-analyzer", action="store_true")
    p.add_argument(
        "--perf-analyzer-max-threads",
        type=int,
        default=None,
        help="perf_analyzer's --max-threads (default: perf_analyzer's own; with --concurrency-range, max(16, the "
        "concurrency), one gRPC stream a thread when streaming)",
    )
    p.add_argument(
        "--perf-analyzer-stability",
        type=float,
        default=10.0,
        help="run_perf.py --stability-percentage (with --max-trials 10): perf_analyzer reports three windows "
        "in a row that agree within it, not a first window that runs few requests (default 10, its own)",
    )
    p.add_argument(
        "--perf-analyzer-warmup",
        type=int,
        default=None,
        help="run_perf.py --warmup-request-count (default: its own, 4 x concurrency; 0: none)",
    )
    p.add_argument(
        "--perf-analyzer-prompts",
        type=int,
        default=4096,
        help="distinct prompts in perf_analyzer's input data (it sends them in turn; more than it sends)",
    )
    p.add_argument("--genai-perf", action="store_true", help="also profile `ouro` with genai-perf")
    p.add_argument(
        "--exit-threshold",
        type=float,
        default=1.0,
        help="every request's exit threshold (1.0: full depth; below 1 the real gate decides)",
    )
    p.add_argument(
        "--depth",
        type=float,
        default=None,
        help="the gate at this mean exit depth: its threshold bisected on engine-direct's untimed runs "
        "(prompts made as the served ones), then used for every timed run, served and direct",
    )
    p.add_argument("--models", nargs="+", default=["ouro"], help="served models to load-test")
    p.add_argument("--skip-direct", action="store_true", help="served only (diagnostics)")
    p.add_argument(
        "--direct-prompts",
        choices=("served", "own"),
        default="served",
        help="engine-direct's timed prompts: the served repeats' own (default: the same tokens, so the gate runs "
        "at the same depth on both sides; two engines, each prefills every prompt once) or prompts of their own",
    )
    p.add_argument(
        "--stand-in",
        action="store_true",
        help="replace the model (benchmarks/stand_in_engine.py) to measure the serving path alone "
        "(implies --skip-direct)",
    )
    p.add_argument(
        "--stand-in-round-ms",
        type=float,
        default=0.0,
        help="with --stand-in: each engine launch takes this long (a GPU round's time), so the engine emits at "
        "a fixed rate and the path's CPU per token shows at a load it carries (0: launches cost nothing)",
    )
    p.add_argument("--client-processes", type=int, default=None, help="client/load.py --processes")
    p.add_argument(
        "--trace",
        action="store_true",
        help="record the served engine's rounds (OURO_ENGINE_TRACE) to OUT/engine_trace.json and "
        "summarize them: steps, busy time, prefill steps, mean running requests",
    )
    p.add_argument("--out", default="served-results")
    p.add_argument(
        "--process",
        action="store_true",
        help="also run the closed loop through the engine process without Triton (a Python client on "
        "its owner channel), to split the serving overhead into process and Triton",
    )
    p.add_argument("--direct", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--process-loop", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--prompt-ids", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.direct:
        direct(args)
        return 0
    if args.process_loop:
        process_loop(args)
        return 0

    from ouro_backend.engine.round_trace import ENV as TRACE_ENV
    from ouro_backend.engine.round_trace import summarize
    from ouro_backend.entrypoints.bench import ensure_shape_checkpoint, median_of
    from ouro_backend.serving import request_trace

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = args.model or (ensure_shape_checkpoint(args.shape) if args.shape != "toy" else None)
    if model is None:
        from ouro_backend.model.toy import ensure_toy_checkpoint

        model = ensure_toy_checkpoint()
    if args.depth and (args.skip_direct or args.stand_in):
        raise SystemExit("--depth finds the threshold on the engine-direct side: not with --skip-direct or --stand-in")
    plan = prompt_plan(model, args)
    prompt_files: dict[str, list[Path]] = {}  # per served model: the warm-up's, then each repeat's
    for name, texts in plan["served"].items():
        prompt_files[name] = []
        for i, batch in enumerate(texts):
            path = out / (f"prompts_{name}_warmup.json" if i == 0 else f"prompts_{name}_{i - 1}.json")
            path.write_text(json.dumps(batch))
            prompt_files[name].append(path)
    if plan["direct"] is not None:
        (out / "direct_prompt_ids.json").write_text(json.dumps(plan["direct"]))
    if plan["process"] is not None:
        (out / "prompt_ids.json").write_text(json.dumps(plan["process"]))
    pa_prompts = out / "prompts_perf_analyzer.json"
    if plan["perf_analyzer"] is not None:
        pa_prompts.write_text(json.dumps(plan["perf_analyzer"]))
    per_phase = (args.repeats + 1) * args.requests
    prompt_tokens = plan["prompt_tokens"]
    print(
        f"prompts: {per_phase} distinct per served phase, {prompt_tokens:.1f} tokens on average; "
        f"{args.requests} requests x {args.output_len} tokens at concurrency {args.concurrency}",
        flush=True,
    )

    def trace_env(name: str) -> dict | None:
        """The environment of a phase: with --trace, its engine records its rounds to OUT/name."""
        return dict(os.environ, **{TRACE_ENV: str((out / name).resolve())}) if args.trace else None

    def phase(flag: str, prompt_file: str, env: dict | None = None) -> dict:
        """One closed-loop phase in a subprocess (its GPU memory is freed before the next phase starts)."""
        res = subprocess.run(
            [
                sys.executable,
                __file__,
                flag,
                "--model",
                model,
                "--prompt-ids",
                str(out / prompt_file),
                "--input-len",
                str(args.input_len),
                *(["--depth", str(args.depth)] if args.depth else []),
                "--concurrency",
                str(args.concurrency),
                "--requests",
                str(args.requests),
                "--output-len",
                str(args.output_len),
                "--repeats",
                str(args.repeats),
                "--exit-threshold",
                str(args.exit_threshold),
            ],
            capture_output=True,
            text=True,
            env=env,
        )
        if res.returncode:
            log = out / f"{flag.lstrip('-')}.stderr.txt"
            log.write_text(res.stderr)
            lines = [x for x in res.stderr.splitlines() if not x.startswith("frame #")]  # C++ stack frames
            raise SystemExit(f"{flag} failed (its stderr: {log}):\n" + "\n".join(lines[-40:]))
        return json.loads(res.stdout.strip().splitlines()[-1])

    direct_res = None if args.skip_direct or args.stand_in else phase("--direct", "direct_prompt_ids.json")
    if direct_res:
        (out / "direct.json").write_text(json.dumps(direct_res, indent=1))
        if args.depth:  # the served side runs at the threshold found for that depth
            args.exit_threshold = direct_res["repeats"][0]["threshold"]
            print(f"--depth {args.depth}: threshold {args.exit_threshold}", flush=True)
    process_res = None
    if args.process:
        process_res = phase("--process-loop", "prompt_ids.json", trace_env("process_trace.json"))
        (out / "process.json").write_text(json.dumps(process_res, indent=1))
        print(
            f"engine process, closed loop on its owner channel: "
            f"{[round(x['output_tok_s']) for x in process_res['repeats']]} output tok/s",
            flush=True,
        )

    http_port, grpc_port, metrics_port = args.port_base, args.port_base + 1, args.port_base + 2
    serve = [
        sys.executable,
        "-m",
        "ouro_backend.entrypoints.serve",
        "--model",
        model,
        "--http-port",
        str(http_port),
        "--grpc-port",
        str(grpc_port),
        "--metrics-port",
        str(metrics_port),
        "--log-file",
        str(out / "tritonserver.log"),
        "--engine-arg",
        f"max_num_seqs={args.concurrency}",
        *[a for kv in args.engine_arg for a in ("--engine-arg", kv)],
        *(["--model-repository", args.model_repository] if args.model_repository else []),
    ]
    server_env = dict(os.environ)
    if args.trace:
        server_env.update(trace_env("engine_trace.json") or {})
        server_env[request_trace.ENV] = str((out / "request_trace").resolve())
    if args.stand_in:
        from benchmarks.stand_in_engine import ROUND_MS_ENV
        from ouro_backend.serving.engine_server import RUNNER_ENV

        server_env[RUNNER_ENV] = "benchmarks.stand_in_engine:StandInRunner"
        server_env[ROUND_MS_ENV] = str(args.stand_in_round_ms)
        server_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    server = subprocess.Popen(
        serve,
        stdout=open(out / "ouro-serve.out", "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=server_env,
    )
    try:
        wait_ready(f"localhost:{grpc_port}", "ouro", 600, server)
        per_model = {}
        timed_from: float | None = None  # when the first timed load began (the trace summary starts there)
        for name in args.models:
            load = [
                sys.executable,
                str(ROOT / "client" / "load.py"),
                "--url",
                f"localhost:{grpc_port}",
                "--model",
                name,
                "-c",
                str(args.concurrency),
                "--max-tokens",
                str(args.output_len),
                "--ignore-eos",
                "--exit-threshold",
                str(args.exit_threshold),
                *(["--processes", str(args.client_processes)] if args.client_processes else []),
            ]
            subprocess.run(
                load
                + ["-n", str(args.concurrency), "--prompts-file", str(prompt_files[name][0])]
                + ["--json", str(out / "served_warmup.json")],
                check=True,
                stdout=subprocess.DEVNULL,
            )
            per_model[name] = []
            for i in range(args.repeats):
                path = out / f"served_{name}_{i}.json"
                # With --trace load.py notes its ends of each request's hops (the warm-up's are left out).
                cpu_before, client_before = server_cpu_seconds(server.pid), os.times()
                timed_from = timed_from or time.perf_counter()  # the trace's clock (CLOCK_MONOTONIC on Linux)
                subprocess.run(
                    load
                    + ["-n", str(args.requests), "--prompts-file", str(prompt_files[name][1 + i]), "--json", str(path)],
                    check=True,
                    stdout=subprocess.DEVNULL,
                    env=dict(os.environ, **{request_trace.ENV: str((out / "request_trace").resolve())})
                    if args.trace
                    else None,
                )
                report = json.loads(path.read_text())
                # Cores each role kept busy over the timed run (the client's include its processes' start-up).
                cpu_after, client_after = server_cpu_seconds(server.pid), os.times()
                dur = report["duration_s"] or 1.0
                report["cpu_cores"] = {
                    role: round((t - cpu_before.get(role, 0.0)) / dur, 2) for role, t in sorted(cpu_after.items())
                }
                client_s = sum(client_after[i] - client_before[i] for i in (2, 3))  # children's user + system
                report["cpu_cores"]["client"] = round(client_s / dur, 2)
                per_model[name].append(report)
            print(
                f"{name}: {[round(x['output_tokens_per_s']) for x in per_model[name]]} output tok/s, errors "
                f"{sum(x['errors'] for x in per_model[name])}",
                flush=True,
            )
        served = per_model[args.models[0]]
        pa = None
        if not args.skip_perf_analyzer:
            # run_perf.py's own options, then perf_analyzer's after "--"
            pa_options = ["--stability-percentage", f"{args.perf_analyzer_stability:g}", "--max-trials", "10"]
            if args.perf_analyzer_warmup is not None:
                pa_options += ["--warmup-request-count", str(args.perf_analyzer_warmup)]
            if args.perf_analyzer_max_threads is not None:
                pa_options += ["--", "--max-threads", str(args.perf_analyzer_max_threads)]
            r = subprocess.run(
                [
                    sys.executable,
                    str(ROOT / "client" / "perf_analyzer" / "run_perf.py"),
                    "--url",
                    f"localhost:{grpc_port}",
                    "--models",
                    "ouro",
                    "--concurrency",
                    str(args.concurrency),
                    "--max-tokens",
                    str(args.output_len),
                    "--exit-threshold",
                    str(args.exit_threshold),
                    "--prompts-file",
                    str(pa_prompts),
                    "--out-dir",
                    str(out / "perf_analyzer"),
                    *pa_options,
                ],
                capture_output=True,
                text=True,
            )
            (out / "perf_analyzer.log").write_text(r.stdout + r.stderr)
            try:
                pa = json.loads(r.stdout)["runs"][0]
            except (ValueError, KeyError, IndexError):
                print("perf_analyzer failed:\n" + (r.stdout + r.stderr)[-2500:], flush=True)
        gp = None
        if args.genai_perf:
            r = subprocess.run(
                [
                    sys.executable,
                    str(ROOT / "client" / "genai_perf" / "run_genai_perf.py"),
                    "--url",
                    f"localhost:{grpc_port}",
                    "--concurrency",
                    str(args.concurrency),
                    "--request-count",
                    str(args.requests),
                    "--input-tokens",
                    str(args.input_len),
                    "--output-tokens",
                    str(args.output_len),
                    "--tokenizer",
                    model,
                    "--artifact-dir",
                    str(out / "genai_perf"),
                ]
                + (["--exit-threshold", str(args.exit_threshold)] if args.exit_threshold < 1 else []),
                capture_output=True,
                text=True,
            )
            (out / "genai_perf.log").write_text(r.stdout + r.stderr)
            try:
                gp = json.loads(r.stdout)
                assert gp["ok"]
            except (ValueError, AssertionError):
                print("genai-perf failed:\n" + (r.stdout + r.stderr)[-2500:], flush=True)
    finally:
        os.killpg(server.pid, signal.SIGINT)
        server.wait(timeout=60)

    summary: dict = dict(
        model=Path(model).name,
        concurrency=args.concurrency,
        workload="full" if args.exit_threshold >= 1 else args.exit_threshold,
        target_depth=args.depth,
        stand_in_engine=args.stand_in,
        stand_in_round_ms=args.stand_in_round_ms if args.stand_in else None,
        streams=args.concurrency,
    )
    if args.trace:
        summary["engine_rounds"] = summarize(str(out / "engine_trace.json"), since=timed_from)  # no warm-up
        summary["request_hops"] = request_trace.summarize(str(out / "request_trace"))
        if process_res:
            summary["process_rounds"] = summarize(str(out / "process_trace.json"))
    s = median_of([{k: v for k, v in x.items() if isinstance(v, (int, float, dict))} for x in served])
    summary.update(
        served_output_tok_s=s["output_tokens_per_s"],
        served_errors=sum(x["errors"] for x in served),
        served_ttft_p50_s=s["ttft_s"]["p50"],
        served_itl_p50_s=s["itl_s"]["p50"],
        served_repeats=[x["output_tokens_per_s"] for x in served],
        served_responses_per_s=s.get("responses_per_s"),
        served_mean_in_flight=s.get("mean_in_flight"),
        served_turnaround_p50_ms=None if s["turnaround_s"]["p50"] is None else 1e3 * s["turnaround_s"]["p50"],
        served_tail_s=s.get("tail_s"),
        served_cpu_cores=s["cpu_cores"],
        tok_s=s["output_tokens_per_s"],
        # The row names (benchmarks/results): the same numbers under short keys.
        served_tok_s=s["output_tokens_per_s"],
        mean_depth=s.get("mean_exit_depth"),
        ttft_p50_ms=dict(served=1e3 * s["ttft_s"]["p50"]),
        distinct_prompts=True,
        served_prompt_tokens_mean=prompt_tokens,
        input_len=args.input_len,
        output_len=args.output_len,
        requests=args.requests,
        repeats=args.repeats,
    )
    if pa and pa.get("output_tok_s"):
        summary.update(
            perf_analyzer_output_tok_s=pa["output_tok_s"],
            perf_analyzer_ok=pa["ok"],
            perf_analyzer_mean_in_flight=pa.get("mean_in_flight"),
            perf_analyzer_measured_in_flight=pa.get("measured_in_flight"),
            perf_analyzer_max_threads=args.perf_analyzer_max_threads,  # None: perf_analyzer's own default
            perf_analyzer_warmup_requests=pa.get("warmup_requests"),
        )
    if gp:
        summary.update(
            genai_perf_output_tok_s=gp["output_token_throughput_per_s"],
            genai_perf_ttft_ms=gp["time_to_first_token_ms"],
            genai_perf_itl_ms=gp["inter_token_latency_ms"],
        )
    if direct_res is not None:  # ratios against engine-direct (not with --skip-direct)
        d = direct_res["median"]
        summary.update(
            direct_output_tok_s=d["output_tok_s"],
            ratio=s["output_tokens_per_s"] / d["output_tok_s"],
            direct_ttft_p50_s=d["ttft_s"]["p50"],
            direct_tpot_p50_s=d["tpot_s"]["p50"],
            direct_repeats=[x["output_tok_s"] for x in direct_res["repeats"]],
            direct_steady_round_ms=d.get("steady_round_ms"),
            direct_tok_s=d["output_tok_s"],
            direct_mean_depth=d.get("mean_exit_depth"),
            direct_cached_prompt_tokens=d.get("cached_prompt_tokens"),
        )
        summary["ttft_p50_ms"]["direct"] = 1e3 * d["ttft_s"]["p50"]
        for tool in ("perf_analyzer", "genai_perf"):
            if f"{tool}_output_tok_s" in summary:
                summary[f"{tool}_ratio"] = summary[f"{tool}_output_tok_s"] / d["output_tok_s"]
    (out / "served_summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
