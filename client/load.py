#!/usr/bin/env python3
"""Closed-loop load generator for the Ouro deployment over gRPC streaming.

    python client/load.py --concurrency 16 --requests 64 --max-tokens 64
    python client/load.py --model ouro_ensemble --concurrency 8 --duration 30 --json out.json

N workers each keep one streaming request in flight (a new one as soon as the previous finishes; over gRPC
each worker keeps one connection and one ModelStreamInfer stream open for all its requests) until
`--requests` requests were sent or `--duration` seconds passed (both bound the run; the run also stops at
`--timeout` for stuck requests). The workers are spread over `--processes` client processes (default one per
16 workers, at most half the machine's cores): one Python process handles only a few thousand responses a
second, and a client that falls behind would add its own queueing to the times it measures (TTFT and ITL are
taken when each response reaches the gRPC stream's callback); on the server's own host, a client that takes
most of the cores slows the server instead. Every process opens its streams before any request is sent.
Reports time to first token, inter-token latency (between streamed responses, per token), request latency and
throughput, as percentiles, the requests open on average (`mean_in_flight`), each worker's turnaround from one
request's end to its next's start and the run's tail after the last request was sent: a table on stderr and
JSON on stdout (or in --json FILE).

genai-perf (client/genai_perf/run_genai_perf.py) is the standard benchmark; this tool is kept for what
genai-perf cannot do: it reads Ouro's own outputs (exact token counts from `num_output_tokens`, where
genai-perf re-tokenizes `text_output` with a Hugging Face tokenizer, and the mean loop exit depth from
`exit_depths`), counts failed requests with samples and goes on (one failed request ends a genai-perf run),
times its own ends of each request's hops through the server when `OURO_REQUEST_TRACE` is set
(ouro_backend/serving/request_trace.py), and it needs neither perf_analyzer nor a tokenizer (`run_load` is a plain
function; tests/test_server_generation.py
calls it, benchmarks/served.py runs this script).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from client.ouro_client import SAMPLE_PROMPTS as PROMPTS
from client.ouro_client import GrpcStream, Result, generate, load_prompts, request_options


def percentiles(values: list[float], ps=(50, 90, 99)) -> dict[str, float | None]:
    if not values:
        return {"mean": None, **{f"p{p}": None for p in ps}, "max": None}
    s = sorted(values)

    def pct(p: float) -> float:
        k = (len(s) - 1) * p / 100.0
        lo, hi = int(k), min(int(k) + 1, len(s) - 1)
        return s[lo] + (s[hi] - s[lo]) * (k - lo)

    return {"mean": sum(s) / len(s), **{f"p{p}": pct(p) for p in ps}, "max": s[-1]}


def _client_process(
    url: str,
    model: str,
    workers: int,
    issued: Any,
    start: Any,
    num_requests: int,
    duration: float,
    options: dict,
    prompts: list[str],
    protocol: str,
    timeout: float,
) -> tuple[list[Result], int]:
    """`workers` threads of this process, each taking the next request number from the shared `issued`
    counter until `num_requests` were issued or `duration` passed -> (their results, threads still running,
    each worker's turnarounds: from one request's end to the start of its next, in seconds).

    NOTE no worker sends before every worker of every process has its stream open: `start` (a barrier of all
    the client processes) is passed once this process's workers are ready. Spawned processes import and
    connect at different times; without it the first ones would run alone for a while, the run would hold
    fewer than `concurrency` requests in flight, and the server would be timed at a lower load."""
    lock = threading.Lock()
    results: list[Result] = []
    turnarounds: list[float] = []
    ready = threading.Barrier(workers + 1)  # this process's workers, with their streams open, and this thread
    go = threading.Event()  # set with `stop_at` once every process is ready
    stop_at = 0.0
    trace = None
    if os.environ.get("OURO_REQUEST_TRACE") and protocol == "grpc":  # the server's hop timing, with our ends
        from ouro_backend.serving.request_trace import RequestTrace

        trace = RequestTrace.from_env("client")

    def worker() -> None:
        # gRPC: one connection and one open stream per worker, reused request after request
        # (perf_analyzer's streaming mode): connecting is not part of a request.
        try:
            stream = GrpcStream(url, trace) if protocol == "grpc" else None
        except Exception as e:
            stream = None
            failed = f"opening the gRPC stream failed: {e}"
        else:
            failed = None
        ready.wait()  # this stream is open
        go.wait()
        if failed is not None:
            with lock:
                results.append(Result(start=time.monotonic(), end=time.monotonic(), error=failed))
            return
        previous: Result | None = None
        try:
            while True:
                with issued.get_lock():
                    if issued.value >= num_requests or time.monotonic() >= stop_at:
                        return
                    i = issued.value
                    issued.value += 1
                r = generate(url, model, prompts[i % len(prompts)], options, protocol, timeout, grpc_stream=stream)
                with lock:
                    results.append(r)
                    if previous is not None:
                        turnarounds.append(r.start - previous.end)
                previous = r
        finally:
            if stream is not None:
                stream.close()

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(workers)]
    for t in threads:
        t.start()
    ready.wait()  # every stream of this process is open
    try:
        start.wait(timeout=120)  # ... and of every other process
    except threading.BrokenBarrierError:  # a process died or hung starting: the others run anyway
        pass
    stop_at = time.monotonic() + duration
    go.set()
    for t in threads:
        t.join(timeout=max(1.0, stop_at + timeout - time.monotonic()))
    if trace is not None:
        trace.write()
    with lock:
        return list(results), sum(t.is_alive() for t in threads), list(turnarounds)


def _child(out: Any, *args: Any) -> None:
    out.put(_client_process(*args))


def run_load(
    url: str,
    model: str,
    concurrency: int,
    num_requests: int,
    duration: float,
    options: dict,
    prompts: list[str],
    protocol: str = "grpc",
    timeout: float = 600.0,
    processes: int = 1,
) -> dict[str, Any]:
    """The closed loop, its workers spread over `processes` client processes: one Python process handles a
    few thousand responses a second, and a client that falls behind delays the very responses it times."""
    processes = max(1, min(processes, concurrency))
    ctx = multiprocessing.get_context("spawn")  # not fork: gRPC channels the caller holds must not be forked
    issued = ctx.Value("l", 0)  # the next request number, shared by every worker of every process
    rest = (num_requests, duration, options, prompts, protocol, timeout)
    shares = [concurrency // processes + (i < concurrency % processes) for i in range(processes)]
    if processes == 1:
        results, unfinished, turnarounds = _client_process(url, model, concurrency, issued, threading.Barrier(1), *rest)
    else:
        start = ctx.Barrier(processes)  # the children start together (see _client_process's NOTE)
        out = ctx.Queue()
        children = [
            ctx.Process(target=_child, args=(out, url, model, n, issued, start, *rest), daemon=True) for n in shares
        ]
        for c in children:
            c.start()
        results, unfinished, turnarounds = [], 0, []
        # Start-up (spawning, imports, connecting) counts against no deadline but this one.
        deadline = time.monotonic() + 120 + duration + timeout + 30
        for _ in children:  # read before joining: a child exits only once its results are taken
            r, u, t = out.get(timeout=max(1.0, deadline - time.monotonic()))
            results += r
            unfinished += u
            turnarounds += t
        for c in children:
            c.join(timeout=10)
    # From the first request sent to the last one ended: the client processes' start-up is not the server's.
    last_end = max((r.end for r in results), default=0.0)
    elapsed = last_end - min(r.start for r in results) if results else 0.0
    # The run's tail: after the last request was sent, fewer requests are open as they finish.
    tail = last_end - max(r.start for r in results) if results else 0.0
    ok = [r for r in results if r.error is None]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    latency = [r.end - r.start for r in ok]
    itl: list[float] = []
    for r in ok:
        prev = None
        for c in r.chunks:
            n = c.num_output_tokens if c.num_output_tokens is not None else len(c.exit_depths)
            if prev is not None and n:
                itl.extend([(c.time - prev) / n] * n)
            prev = c.time
    tokens = sum(r.num_tokens for r in ok)
    depths = [d for r in ok for d in r.exit_depths]
    return {
        "model": model,
        "protocol": protocol,
        "concurrency": concurrency,
        "requests": len(results),
        "errors": len(results) - len(ok),
        "error_samples": sorted({r.error for r in results if r.error})[:5],
        "duration_s": elapsed,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / elapsed if elapsed else None,
        "requests_per_s": len(ok) / elapsed if elapsed else None,
        "responses": sum(len(r.chunks) for r in ok),  # streamed responses (a response may carry several tokens)
        "responses_per_s": sum(len(r.chunks) for r in ok) / elapsed if elapsed else None,
        "mean_exit_depth": sum(depths) / len(depths) if depths else None,
        "distinct_prompts": min(len(prompts), len(results)),
        "ttft_s": percentiles(ttft),
        "itl_s": percentiles(itl),
        "latency_s": percentiles(latency),
        # requests open on average over the run (sum of latencies / duration): below `concurrency` by the
        # ramp, the tail and the client's own time between a request's end and its worker's next request
        "mean_in_flight": sum(latency) / elapsed if elapsed else None,
        "turnaround_s": percentiles(turnarounds),  # a worker's time from one request's end to its next's start
        "tail_s": tail,
        "unfinished_workers": unfinished,
        "client_processes": processes,
    }


def default_processes(concurrency: int, cores: int | None = None) -> int:
    """One client process per 16 workers, but at most half of this machine's cores: a load generator on the
    server's own host that takes more starves the server it measures."""
    cores = cores or os.cpu_count() or 2
    return max(1, min(-(-concurrency // 16), cores // 2))


def format_table(report: dict[str, Any]) -> str:
    def ms(v):
        return "-" if v is None else f"{v * 1e3:9.1f}"

    lines = [
        f"{report['model']} ({report['protocol']}), concurrency {report['concurrency']}: "
        f"{report['requests']} requests ({report['errors']} errors) in {report['duration_s']:.1f} s, "
        f"{report['output_tokens']} tokens, {report['output_tokens_per_s'] or 0:.1f} tok/s, "
        f"{report['requests_per_s'] or 0:.2f} req/s, mean exit depth {report['mean_exit_depth'] or 0:.2f}",
        f"{'metric (ms)':<14}{'mean':>9}{'p50':>10}{'p90':>10}{'p99':>10}{'max':>10}",
    ]
    for key, name in (("ttft_s", "TTFT"), ("itl_s", "ITL"), ("latency_s", "latency")):
        p = report[key]
        lines.append(f"{name:<14}{ms(p['mean'])} {ms(p['p50'])} {ms(p['p90'])} {ms(p['p99'])} {ms(p['max'])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="localhost:8001")
    p.add_argument("--protocol", choices=["grpc", "http"], default="grpc")
    p.add_argument("--model", default="ouro")
    p.add_argument("--concurrency", "-c", type=int, default=8)
    p.add_argument(
        "--processes",
        type=int,
        default=None,
        help="client processes the workers are spread over (default: one per 16 workers, at most half of this "
        "machine's cores)",
    )
    p.add_argument("--requests", "-n", type=int, default=32, help="max requests to send")
    p.add_argument("--duration", type=float, default=120.0, help="stop sending new requests after this (s)")
    p.add_argument("--timeout", type=float, default=300.0, help="per-request timeout (s)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="generate exactly --max-tokens tokens (default; --no-ignore-eos stops at EOS)",
    )
    p.add_argument("--exit-threshold", type=float, default=None)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", action="append", default=None, help="prompt (repeatable; default: built-in set)")
    src.add_argument(
        "--prompts-file",
        default=None,
        help="a JSON list of prompts; request i sends prompt i (cycling only when there are fewer prompts than "
        "requests), so a file of at least --requests distinct prompts gives every request a prompt of its own",
    )
    p.add_argument("--json", default=None, help="write the JSON report here (default: stdout)")
    args = p.parse_args(argv)
    prompts = load_prompts(args.prompts_file) if args.prompts_file else args.prompt or PROMPTS
    options = request_options(
        max_tokens=args.max_tokens,
        stream=True,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        exit_threshold=args.exit_threshold,
        exclude_input_in_output=True,
        return_num_output_tokens=True,
    )
    report = run_load(
        args.url,
        args.model,
        args.concurrency,
        args.requests,
        args.duration,
        options,
        prompts,
        args.protocol,
        args.timeout,
        processes=args.processes or default_processes(args.concurrency),
    )
    print(format_table(report), file=sys.stderr)
    text = json.dumps(report, indent=2)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
