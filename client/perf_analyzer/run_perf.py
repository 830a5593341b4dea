#!/usr/bin/env python3
"""Run perf_analyzer (gRPC, streaming) against the Ouro deployment and summarize.

    python client/perf_analyzer/run_perf.py                                  # ouro + ouro_ensemble, c=1,4
    python client/perf_analyzer/run_perf.py --models ouro --concurrency 1 8 16 --max-tokens 64 --out-dir pa_out

For each model and concurrency: `perf_analyzer -m MODEL -i grpc --streaming --input-data FILE
--concurrency-range C` (decoupled models: latency is to the first response, "Response Throughput" counts
streamed responses, which may carry several tokens each; output tok/s is requests/s x max_tokens, exact
because EOS is ignored). perf_analyzer comes from client/perf_analyzer/locate.py (downloaded on first use).
Writes each run's CSV (`-f`) and stdout log to --out-dir and prints a JSON summary; exits 1 if any run failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from locate import PerfAnalyzerUnavailable, check, locate
from make_input_data import make_input_data

_FIELDS = {
    "request_count": r"Request count: (\d+)",
    "throughput_infer_per_s": r"\n\s*Throughput: ([\d.]+) infer/sec",
    "response_throughput_per_s": r"Response Throughput: ([\d.]+) infer/sec",
    "avg_latency_us": r"Avg latency: (\d+) usec",
    "p50_latency_us": r"p50 latency: (\d+) usec",
    "p99_latency_us": r"p99 latency: (\d+) usec",
}
_ERRORS = re.compile(r"(error|failed|Failed|Thread \[\d+\] had error|unexpected)", re.I)


def run_one(
    binary: str,
    env: dict,
    url: str,
    model: str,
    concurrency: int,
    input_file: str,
    out_dir: str,
    measurement_ms: int,
    max_trials: int,
    timeout: float,
    extra: list[str],
) -> dict[str, Any]:
    csv = os.path.join(out_dir, f"{model}_c{concurrency}.csv")
    cmd = [
        binary,
        "-m",
        model,
        "-i",
        "grpc",
        "--streaming",
        "-u",
        url,
        "--input-data",
        input_file,
        "--concurrency-range",
        str(concurrency),
        "--measurement-interval",
        str(measurement_ms),
        "--max-trials",
        str(max_trials),
        "--stability-percentage",
        "999",
        "-f",
        csv,
        *extra,
    ]
    t0 = time.monotonic()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
        out, code = r.stdout + r.stderr, r.returncode
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        code = "timeout"
    with open(os.path.join(out_dir, f"{model}_c{concurrency}.log"), "w") as f:
        f.write(" ".join(cmd) + "\n\n" + out)
    res: dict[str, Any] = {
        "model": model,
        "concurrency": concurrency,
        "exit_code": code,
        "seconds": round(time.monotonic() - t0, 2),
    }
    for key, pattern in _FIELDS.items():
        m = re.search(pattern, out)
        res[key] = float(m.group(1)) if m else None
    error_lines = [
        ln.strip()
        for ln in out.splitlines()
        if _ERRORS.search(ln) and "Failed to init NVML" not in ln and "error_" not in ln
    ]
    res["errors"] = error_lines[:10]
    res["ok"] = code == 0 and not error_lines and (res["request_count"] or 0) > 0
    if not res["ok"]:
        res["output_tail"] = out[-2000:]
    return res


def run(
    url: str = "localhost:8001",
    models: tuple[str, ...] = ("ouro", "ouro_ensemble"),
    concurrency: tuple[int, ...] = (1, 4),
    max_tokens: int = 32,
    num_prompts: int = 8,
    measurement_ms: int = 3000,
    max_trials: int = 5,
    timeout: float = 300.0,
    out_dir: str | None = None,
    exit_threshold: float | None = None,
    extra: list[str] | None = None,
    prompts: list[str] | None = None,
) -> dict[str, Any]:
    binary, env = locate()
    check(binary, env)
    out_dir = out_dir or tempfile.mkdtemp(prefix="ouro-perf-")
    os.makedirs(out_dir, exist_ok=True)
    input_file = os.path.join(out_dir, "input_data.json")
    with open(input_file, "w", encoding="utf-8") as f:
        json.dump(
            make_input_data(num_prompts, max_tokens, exit_threshold=exit_threshold, prompts=prompts),
            f,
            ensure_ascii=False,
        )
    runs = [
        run_one(binary, env, url, m, c, input_file, out_dir, measurement_ms, max_trials, timeout, extra or [])
        for m in models
        for c in concurrency
    ]
    for r in runs:  # EOS is ignored, so every request makes exactly max_tokens tokens
        r["output_tok_s"] = r["throughput_infer_per_s"] * max_tokens if r["throughput_infer_per_s"] else None
    return {"perf_analyzer": binary, "out_dir": out_dir, "ok": all(r["ok"] for r in runs), "runs": runs}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="localhost:8001", help="gRPC endpoint")
    p.add_argument("--models", nargs="+", default=["ouro", "ouro_ensemble"])
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 4])
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--exit-threshold", type=float, default=None)
    p.add_argument("--measurement-interval", type=int, default=3000, help="ms per measurement window")
    p.add_argument("--max-trials", type=int, default=5)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per perf_analyzer run")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--prompt", action="append", default=None, help="prompt (repeatable; default: built-in set)")
    p.add_argument("extra", nargs="*", help="extra perf_analyzer arguments (after --)")
    args = p.parse_args(argv)
    try:
        report = run(
            args.url,
            tuple(args.models),
            tuple(args.concurrency),
            args.max_tokens,
            args.num_prompts,
            args.measurement_interval,
            args.max_trials,
            args.timeout,
            args.out_dir,
            args.exit_threshold,
            args.extra,
            args.prompt,
        )
    except PerfAnalyzerUnavailable as e:
        print(f"perf_analyzer unavailable: {e}", file=sys.stderr)
        return 2
    for r in report["runs"]:
        print(
            f"{r['model']:<14} c={r['concurrency']:<3} {'ok ' if r['ok'] else 'FAIL'} "
            f"{r['throughput_infer_per_s'] or 0:8.2f} req/s {r['output_tok_s'] or 0:9.1f} output tok/s "
            f"{r['response_throughput_per_s'] or 0:9.1f} resp/s "
            f"first-response latency avg {(r['avg_latency_us'] or 0) / 1e3:8.1f} ms",
            file=sys.stderr,
        )
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
