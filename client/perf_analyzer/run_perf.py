#!/usr/bin/env python3
"""Run perf_analyzer (gRPC, streaming) against the Ouro deployment and summarize.

    python client/perf_analyzer/run_perf.py                                  # ouro + ouro_ensemble, c=1,4
    python client/perf_analyzer/run_perf.py --models ouro --concurrency 1 8 16 --max-tokens 64 --out-dir pa_out

For each model and concurrency: `perf_analyzer -m MODEL -i grpc --streaming --input-data FILE
--concurrency-range C --measurement-mode count_windows --measurement-request-count N
--warmup-request-count W --profile-export-file FILE`. A measurement window lasts until N requests (default
max(3, 2 x C)) have finished, however long a request takes; `--measurement-interval MS` uses fixed time
windows instead, which fail ("No valid requests recorded within time interval") when no request finishes
inside one.
W (default 4 x C; 1 at C1) requests run unmeasured first, so that a run's unsteady start does not count in
its first window (README.md, "Warm-up", says what one looked like).

What is measured, per run:
* request latency: perf_analyzer's latency, from sending a request to its last response (perf_analyzer
  2.50 prints "using the first response for measuring latency" for a decoupled model, but measures to the
  last one);
* first-response latency (TTFT): computed here from perf_analyzer's profile export (each request's send
  time and response timestamps), over the requests that finished inside its measurement windows;
* throughput: requests/s, streamed responses/s (a response may carry several tokens), and output tok/s =
  requests/s x max_tokens, exact because EOS is ignored.
perf_analyzer comes from client/perf_analyzer/locate.py (downloaded on first use). Writes each run's CSV
(`-f`), profile export and stdout log to --out-dir and prints a JSON summary; exits 1 if any run failed,
with a hint on stderr.
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
from make_input_data import make_input_data  # (it puts the repository root on sys.path)

from client.ouro_client import load_prompts

_FIELDS = {
    "request_count": r"Request count: (\d+)",
    "throughput_infer_per_s": r"\n\s*Throughput: ([\d.]+) infer/sec",
    "response_throughput_per_s": r"Response Throughput: ([\d.]+) infer/sec",
    # perf_analyzer's latency: send to the LAST response of a request (see the module docstring)
    "request_latency_avg_us": r"Avg latency: (\d+) usec",
    "request_latency_p50_us": r"p50 latency: (\d+) usec",
    "request_latency_p90_us": r"p90 latency: (\d+) usec",
    "request_latency_p99_us": r"p99 latency: (\d+) usec",
}
_ERRORS = re.compile(r"(error|failed|Failed|Thread \[\d+\] had error|unexpected)", re.I)
NO_VALID_REQUESTS = "No valid requests recorded within time interval"
NO_STABILITY_CHECK = 999.0  # a --stability-percentage no three windows can miss: the first three count


def default_request_count(concurrency: int) -> int:
    """Requests per count window: enough for each of the C streams to finish about two."""
    return max(3, 2 * concurrency)


def default_warmup_count(concurrency: int) -> int:
    """Unmeasured requests before the first window: four per concurrent request, one at C1."""
    return 4 * concurrency if concurrency > 1 else 1


def check_warmup(warmup_request_count: int | None, concurrency: int) -> None:
    """Raises ValueError for a warm-up perf_analyzer cannot finish: 2.50 hangs when it is fewer requests than
    the concurrency (C4 with 2, C8 with 4; C4 with 4 or 16 finished)."""
    if warmup_request_count is not None and 0 < warmup_request_count < concurrency:
        raise ValueError(
            f"--warmup-request-count {warmup_request_count} is below the concurrency {concurrency}: perf_analyzer "
            f"hangs then; give 0 (none) or at least {concurrency}"
        )


def _percentile(sorted_values: list[float], p: float) -> float:
    """perf_analyzer's rule: the value at rank round(p/100 x (n-1))."""
    return sorted_values[int(p / 100.0 * (len(sorted_values) - 1) + 0.5)]


def load_export(profile_export: str) -> dict | None:
    """perf_analyzer's profile export (read once per run: 9 MB at C64), or None if missing or unreadable."""
    try:
        with open(profile_export) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def first_response_latency(export: dict) -> dict[str, float] | None:
    """TTFT stats in ms (avg, p50, p90, p99, min, max, count) from a perf_analyzer profile export: each
    request's first response timestamp minus its send timestamp, over the requests whose last response
    falls inside the measurement windows (the ones perf_analyzer's own numbers count). None if there are
    no such requests."""
    ttft = []
    for experiment in export.get("experiments") or []:
        bounds = experiment.get("window_boundaries") or []
        lo, hi = (bounds[0], bounds[-1]) if len(bounds) >= 2 else (None, None)
        for r in experiment.get("requests") or []:
            times = r.get("response_timestamps") or []
            if not times:
                continue
            if lo is not None and not lo <= times[-1] <= hi:
                continue
            ttft.append((times[0] - r["timestamp"]) / 1e6)
    if not ttft:
        return None
    ttft.sort()
    stats = {f"p{p}": _percentile(ttft, p) for p in (50, 90, 99)}
    return {"avg": sum(ttft) / len(ttft), **stats, "min": ttft[0], "max": ttft[-1], "count": len(ttft)}


def request_timeline(export: dict) -> dict | None:
    """The export reduced to what pacing questions need (under 2% of its size at C64): the first experiment's
    window boundaries and, per request that got responses, its send time, first and last response time (ns)
    and number of responses. None without an experiment."""
    for experiment in export.get("experiments") or []:
        requests = [
            {"send": r["timestamp"], "first": t[0], "last": t[-1], "responses": len(t)}
            for r in experiment.get("requests") or []
            if (t := r.get("response_timestamps"))
        ]
        return {"window_boundaries": experiment.get("window_boundaries") or [], "requests": requests}
    return None


def measured_in_flight(timeline: dict) -> float | None:
    """Requests open on average over perf_analyzer's measurement windows up to its last send, from its request
    timeline (`request_timeline`: each request's send and last response), or None without windows.
    perf_analyzer stops sending once its last window's requests are out and that window then closes on a drain
    (the requests still open finish with no successors): the drain says nothing about the concurrency it
    kept, so it is left out."""
    bounds, requests = timeline["window_boundaries"], timeline["requests"]
    if len(bounds) < 2:
        return None
    lo, hi = bounds[0], bounds[-1]
    last_send = max((r["send"] for r in requests), default=hi)
    if lo < last_send < hi:
        hi = last_send
    return sum(max(0, min(r["last"], hi) - max(r["send"], lo)) for r in requests) / (hi - lo)


def failure_hint(res: dict[str, Any], out: str, url: str) -> str:
    """One line saying what to change when a run failed."""
    if res["exit_code"] == "timeout":
        return (
            f"perf_analyzer did not finish within --timeout {res['timeout_s']:g} s: raise --timeout, or lower "
            f"--measurement-request-count, --max-trials or --max-tokens"
        )
    if NO_VALID_REQUESTS in out:
        return (
            f"no request finished inside a {res['measurement_interval_ms']} ms measurement window: a request "
            f"(max_tokens {res['max_tokens']}) takes longer than that here. Leave out --measurement-interval "
            f"(count windows: each window waits until --measurement-request-count requests have finished), or "
            f"make it several times a request's duration"
        )
    if re.search(r"failed to connect|connection refused|unavailable|deadline exceeded", out, re.I):
        return f"cannot reach the server at {url}: is it up (ouro-serve), and is --url its gRPC port?"
    if "Failed to obtain stable measurement" in out:
        return "perf_analyzer found no stable measurement: raise --max-trials"
    return f"see perf_analyzer's output in {res['log']}"


def run_one(
    binary: str,
    env: dict,
    url: str,
    model: str,
    concurrency: int,
    input_file: str,
    out_dir: str,
    measurement_ms: int | None,
    max_trials: int,
    timeout: float,
    extra: list[str],
    measurement_request_count: int | None = None,
    max_tokens: int | None = None,
    warmup_request_count: int | None = None,
    stability_percentage: float = NO_STABILITY_CHECK,
) -> dict[str, Any]:
    """One perf_analyzer run. measurement_ms: fixed time windows of that length; None: count windows of
    measurement_request_count requests (default: default_request_count(concurrency)). warmup_request_count:
    unmeasured requests first (default: default_warmup_count(concurrency); 0: none). stability_percentage:
    perf_analyzer reports the first three windows in a row whose throughput and latency agree within it
    (NO_STABILITY_CHECK: its first three)."""
    stem = os.path.join(out_dir, f"{model}_c{concurrency}")
    csv, export, log = stem + ".csv", stem + ".profile_export.json", stem + ".log"
    if measurement_ms:
        window = ["--measurement-mode", "time_windows", "--measurement-interval", str(measurement_ms)]
    else:
        count = measurement_request_count or default_request_count(concurrency)
        window = ["--measurement-mode", "count_windows", "--measurement-request-count", str(count)]
    warmup = default_warmup_count(concurrency) if warmup_request_count is None else warmup_request_count
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
        *window,
        "--max-trials",
        str(max_trials),
        "--stability-percentage",
        f"{stability_percentage:g}",
        "-f",
        csv,
        "--profile-export-file",
        export,
        *(["--warmup-request-count", str(warmup)] if warmup else []),
        *extra,
    ]
    timeline_path = stem + ".requests.json"
    for stale in (export, timeline_path):  # a failed run must not report an earlier run's
        if os.path.exists(stale):
            os.remove(stale)
    t0 = time.monotonic()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
        out, code = r.stdout + r.stderr, r.returncode
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        code = "timeout"
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n\n" + out)
    res: dict[str, Any] = {
        "model": model,
        "concurrency": concurrency,
        "exit_code": code,
        "seconds": round(time.monotonic() - t0, 2),
        "measurement": (
            {"mode": "time_windows", "interval_ms": measurement_ms}
            if measurement_ms
            else {"mode": "count_windows", "requests_per_window": int(window[-1])}
        ),
        "warmup_requests": warmup,
        "stability_percentage": stability_percentage,
        "log": log,
        "profile_export": export if os.path.exists(export) else None,
    }
    for key, pattern in _FIELDS.items():
        m = re.search(pattern, out)
        res[key] = float(m.group(1)) if m else None
    exported = load_export(export) if res["profile_export"] else None
    res["first_response_latency_ms"] = first_response_latency(exported) if exported else None
    timeline = request_timeline(exported) if exported else None
    res["measured_in_flight"] = measured_in_flight(timeline) if timeline else None
    res["request_timeline"] = timeline_path if timeline else None
    if timeline:  # small enough to bring back from a device run, unlike the export
        with open(timeline_path, "w") as f:
            json.dump(timeline, f, separators=(",", ":"))
    error_lines = [
        ln.strip()
        for ln in out.splitlines()
        if (_ERRORS.search(ln) or NO_VALID_REQUESTS in ln) and "Failed to init NVML" not in ln and "error_" not in ln
    ]
    res["warnings"] = []
    if code == 0 and exported is None:  # seen once under CPU contention: a full report and a 0-byte export
        state = f"unreadable ({os.path.getsize(export)} bytes)" if res["profile_export"] else "missing"
        res["warnings"].append(
            f"perf_analyzer left its profile export {export} {state}: no first-response latency or measured "
            f"in-flight for this run; its own throughput and latency stand"
        )
    res["errors"] = error_lines[:10]
    res["ok"] = code == 0 and not error_lines and (res["request_count"] or 0) > 0
    if not res["ok"]:
        res["hint"] = failure_hint(
            dict(res, timeout_s=timeout, measurement_interval_ms=measurement_ms, max_tokens=max_tokens), out, url
        )
        res["output_tail"] = out[-2000:]
    return res


def run(
    url: str = "localhost:8001",
    models: tuple[str, ...] = ("ouro", "ouro_ensemble"),
    concurrency: tuple[int, ...] = (1, 4),
    max_tokens: int = 32,
    num_prompts: int = 8,
    measurement_ms: int | None = None,
    max_trials: int = 5,
    timeout: float = 300.0,
    out_dir: str | None = None,
    exit_threshold: float | None = None,
    extra: list[str] | None = None,
    prompts: list[str] | None = None,
    measurement_request_count: int | None = None,
    warmup_request_count: int | None = None,
    stability_percentage: float = NO_STABILITY_CHECK,
) -> dict[str, Any]:
    """measurement_ms None (default): count windows; a number: time windows of that many ms."""
    for c in concurrency:
        check_warmup(warmup_request_count, c)
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
        run_one(
            binary,
            env,
            url,
            m,
            c,
            input_file,
            out_dir,
            measurement_ms,
            max_trials,
            timeout,
            extra or [],
            measurement_request_count=measurement_request_count,
            max_tokens=max_tokens,
            warmup_request_count=warmup_request_count,
            stability_percentage=stability_percentage,
        )
        for m in models
        for c in concurrency
    ]
    for r in runs:  # EOS is ignored, so every request makes exactly max_tokens tokens
        r["output_tok_s"] = r["throughput_infer_per_s"] * max_tokens if r["throughput_infer_per_s"] else None
        # Requests open on average (Little's law): below the concurrency asked for when perf_analyzer itself
        # is slow to send the next request after one ends.
        rate, latency = r.get("throughput_infer_per_s"), r.get("request_latency_avg_us")
        r["mean_in_flight"] = rate * latency / 1e6 if rate and latency else None
    return {"perf_analyzer": binary, "out_dir": out_dir, "ok": all(r["ok"] for r in runs), "runs": runs}


def format_run(r: dict[str, Any]) -> str:
    def ms(us):
        return "-" if us is None else f"{us / 1e3:.1f}"

    ttft = r.get("first_response_latency_ms") or {}
    first = "-" if not ttft else f"{ttft['p50']:.1f}"
    return (
        f"{r['model']:<14} c={r['concurrency']:<3} {'ok ' if r['ok'] else 'FAIL'} "
        f"{r['throughput_infer_per_s'] or 0:8.2f} req/s {r['output_tok_s'] or 0:9.1f} output tok/s "
        f"{r['response_throughput_per_s'] or 0:9.1f} resp/s  "
        f"request latency (send to last response) avg {ms(r['request_latency_avg_us'])} ms "
        f"p50 {ms(r['request_latency_p50_us'])} ms  first response (TTFT) p50 {first} ms  "
        f"in flight {r.get('mean_in_flight') or 0:.1f} (measured {r.get('measured_in_flight') or 0:.1f})"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="localhost:8001", help="gRPC endpoint")
    p.add_argument("--models", nargs="+", default=["ouro", "ouro_ensemble"])
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 4])
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--exit-threshold", type=float, default=None)
    p.add_argument(
        "--measurement-request-count",
        type=int,
        default=None,
        help="count windows (the default): a window lasts until this many requests have finished "
        "(default: max(3, 2 x concurrency))",
    )
    p.add_argument(
        "--measurement-interval",
        type=int,
        default=None,
        help="time windows of this many ms instead of count windows; a window in which no request "
        "finishes fails the run, so make it several times a request's duration",
    )
    p.add_argument(
        "--warmup-request-count",
        type=int,
        default=None,
        help="unmeasured requests before the first window (default: 4 x concurrency, 1 at concurrency 1; 0: "
        "none; else at least the concurrency): a run's first seconds need not be steady",
    )
    p.add_argument(
        "--stability-percentage",
        type=float,
        default=NO_STABILITY_CHECK,
        help="report the first three windows in a row whose throughput and latency agree within this many "
        "percent (perf_analyzer's own check; e.g. 10 with --max-trials 10 for a steady state on a GPU server, "
        "whose first window after the warm-up can run few requests: README.md, 'Warm-up'); default: no "
        "check, the first three windows",
    )
    p.add_argument("--max-trials", type=int, default=5)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per perf_analyzer run")
    p.add_argument("--out-dir", default=None)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", action="append", default=None, help="prompt (repeatable; default: built-in set)")
    src.add_argument(
        "--prompts-file",
        default=None,
        help="a JSON list of prompts, one input-data entry each (--num-prompts is then their number): "
        "perf_analyzer sends the entries in turn, so as many distinct prompts as requests keep the "
        "server's prefix cache from serving repeats",
    )
    p.add_argument("extra", nargs="*", help="extra perf_analyzer arguments (after --)")
    args = p.parse_args(argv)
    prompts = args.prompt
    if args.prompts_file:
        prompts = load_prompts(args.prompts_file)
        args.num_prompts = len(prompts)
    if args.measurement_interval is not None and args.measurement_request_count is not None:
        p.error("--measurement-interval (time windows) excludes --measurement-request-count (count windows)")
    try:
        for c in args.concurrency:
            check_warmup(args.warmup_request_count, c)
    except ValueError as e:
        p.error(str(e))
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
            prompts,
            measurement_request_count=args.measurement_request_count,
            warmup_request_count=args.warmup_request_count,
            stability_percentage=args.stability_percentage,
        )
    except PerfAnalyzerUnavailable as e:
        print(f"perf_analyzer unavailable: {e}", file=sys.stderr)
        return 2
    for r in report["runs"]:
        print(format_run(r), file=sys.stderr)
    for r in report["runs"]:
        for w in r["warnings"]:
            print(f"run_perf: {r['model']} c={r['concurrency']}: {w}", file=sys.stderr)
        if not r["ok"]:
            print(
                f"run_perf: {r['model']} c={r['concurrency']} failed (exit {r['exit_code']}): {r['hint']}\n"
                f"  perf_analyzer said: {'; '.join(r['errors'][-2:]) or '-'}\n  log: {r['log']}",
                file=sys.stderr,
            )
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
