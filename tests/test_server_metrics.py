"""Metrics through a real tritonserver: the Prometheus metrics (their types: counts are counters, levels
gauges), perf_analyzer against the server, and every query of the Grafana dashboard (each metric exists,
rate() only over counters, deriv() only over gauges).

The shared server is conftest.py's session fixture `server`; the helpers are in server_common.py."""

from __future__ import annotations

import json
import os
import re
import sys
import urllib.request

import pytest
from helpers import wait_for
from server_common import PROMPT, ROOT, all_flags, metrics

from client.ouro_client import generate, request_options
from ouro_backend.serving.metrics import GAUGE_KEYS, STAT_COUNTERS, STAT_GAUGES

pytestmark = pytest.mark.timeout(300)

# Triton 2.51's GPU metrics (docs/user_guide/metrics.md; all per GPU, label gpu_uuid): the dashboard's GPU
# panels read them. The test server runs on the CPU, where Triton exposes none, so their names and types are
# checked against this table there, and against the metrics port where a GPU server exposes them.
TRITON_GPU_METRICS = {
    "nv_gpu_utilization": "gauge",
    "nv_gpu_memory_total_bytes": "gauge",
    "nv_gpu_memory_used_bytes": "gauge",
    "nv_gpu_power_usage": "gauge",
    "nv_gpu_power_limit": "gauge",
    "nv_energy_consumption": "counter",
}
COUNTER_FUNCTIONS = ("rate", "irate", "increase", "resets")  # meaningless on a gauge
GAUGE_FUNCTIONS = ("deriv", "delta", "idelta", "predict_linear")  # meaningless on a counter


def scrape_text(server) -> tuple[str, dict[str, str]]:
    """(the metrics port's text, {family: its `# TYPE`})."""
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    return text, dict(re.findall(r"^# TYPE (\S+) (\S+)", text, re.M))


def stat_series(text: str, family: str) -> dict[str, float]:
    """{stat label: value summed over the other labels} of ouro_engine_stat or ouro_engine_stat_total."""
    out: dict[str, float] = {}
    for labels, value in re.findall(rf"^{family}\{{([^}}]*)\}} (\S+)$", text, re.M):
        stat = re.search(r'stat="([^"]*)"', labels).group(1)
        out[stat] = out.get(stat, 0.0) + float(value)
    return out


# ------------------------------------------------------------------------------------------- metrics, perf


def test_metrics(server):
    # A request of its own that exits at mixed depths (see test_grpc_streaming_matches_offline).
    r = generate(server.grpc_url, "ouro", PROMPT, all_flags(max_tokens=24, temperature=0.0, exit_threshold=0.7))
    assert r.error is None and min(r.exit_depths) < 4
    # Published within about 2 x metrics_interval_s (engine process -> ouro_engine -> server).
    m = wait_for(
        lambda: (lambda m: m if m.get("ouro_request_success_total") and m.get("ouro_exit_depth_bucket{3}") else None)(
            metrics(server)
        )
    )
    assert m, metrics(server)
    for name in (
        "ouro_prompt_tokens_total",
        "ouro_generation_tokens_total",
        "ouro_requests_aborted_total",
        "ouro_kv_cache_usage_ratio",
        "ouro_num_requests_running",
        "ouro_num_requests_waiting",
        "ouro_num_requests_swapped",
        "ouro_num_preemptions_total",
        "ouro_time_to_first_token_seconds_count",
        "ouro_time_per_output_token_seconds_count",
        "ouro_e2e_request_latency_seconds_count",
        "ouro_exit_depth_count",
        "ouro_request_success_total",
    ):
        assert name in m, f"{name} missing from {sorted(m)}"
    assert m["ouro_generation_tokens_total"] > 0 and m["ouro_exit_depth_count"] > 0
    assert m["ouro_time_to_first_token_seconds_count"] > 0
    # exit depths are integers 1..4: the le="1" .. le="4" buckets hold them all, some below depth 4
    assert m["ouro_exit_depth_bucket{4}"] == m["ouro_exit_depth_count"]
    assert m["ouro_exit_depth_bucket{3}"] > 0


def test_counts_are_counters_and_levels_are_gauges(server, llm):
    """On the real server's metrics port: every monotonic count is a Prometheus counter (`# TYPE ... counter`,
    so rate() works and a dashboard needs no deriv()): the *_total families and the engine's counts from
    LLMEngine.stats() (ouro_engine_stat_total{stat}); levels (queues, KV usage, free blocks) are gauges.
    The counters grow with the tokens served; every numeric entry of stats() is one or the other."""
    numeric = {k for k, v in llm.engine.stats().items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    unclassified = numeric - STAT_COUNTERS - STAT_GAUGES - set(GAUGE_KEYS)
    assert not unclassified, f"LLMEngine.stats() entries neither in STAT_COUNTERS nor a level: {unclassified}"
    assert not STAT_COUNTERS & (STAT_GAUGES | set(GAUGE_KEYS))

    def served(max_tokens):
        r = generate(server.grpc_url, "ouro", PROMPT, all_flags(max_tokens=max_tokens, temperature=0.0))
        assert r.error is None and r.num_tokens == max_tokens
        return r

    served(6)
    # Published within about 2 x metrics_interval_s (engine process -> ouro_engine -> server).
    scraped = wait_for(
        lambda: (lambda t: t if "ouro_engine_stat_total{" in t[0] and "ouro_request_success_total{" in t[0] else None)(
            scrape_text(server)
        )
    )
    assert scraped, f"no ouro_engine_stat_total series on {server.metrics_url}"
    text, types = scraped
    for family in (
        "ouro_prompt_tokens_total",
        "ouro_generation_tokens_total",
        "ouro_request_success_total",
        "ouro_requests_aborted_total",
        "ouro_request_errors_total",
        "ouro_num_preemptions_total",
        "ouro_server_restarts_total",
        "ouro_engine_stat_total",
    ):
        assert types.get(family) == "counter", f"# TYPE {family} {types.get(family)}, not counter"
    for family in [*GAUGE_KEYS.values(), "ouro_engine_stat"]:
        assert types.get(family) == "gauge", f"# TYPE {family} {types.get(family)}, not gauge"
    assert all(not n.startswith("ouro_") or t in ("counter", "gauge", "histogram") for n, t in types.items())

    counts, levels = stat_series(text, "ouro_engine_stat_total"), stat_series(text, "ouro_engine_stat")
    assert set(counts) == STAT_COUNTERS & numeric, "every count of stats() is a counter series, from the start"
    assert set(levels) <= STAT_GAUGES and {"kv_blocks_free", "kv_blocks_total"} <= set(levels), levels
    assert counts["rounds"] > 0 and counts["launches"] > 0 and counts["steps"] > 0, counts

    before = counts
    tokens = metrics(server)["ouro_generation_tokens_total"]
    served(9)
    grown = wait_for(
        lambda: (lambda c: c if c.get("generation_tokens", 0) >= before["generation_tokens"] + 9 else None)(
            stat_series(scrape_text(server)[0], "ouro_engine_stat_total")
        )
    )
    assert grown, "ouro_engine_stat_total did not count the request's tokens"
    assert all(grown[k] >= before[k] for k in before), "a counter went down"
    assert grown["rounds"] > before["rounds"] and grown["launches"] > before["launches"]
    assert wait_for(lambda: metrics(server)["ouro_generation_tokens_total"] >= tokens + 9)


def test_perf_analyzer(server, tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "client", "perf_analyzer"))
    from locate import PerfAnalyzerUnavailable
    from run_perf import run

    try:
        report = run(
            server.grpc_url,
            models=("ouro", "ouro_ensemble"),
            concurrency=(2,),
            max_tokens=8,
            measurement_ms=1000,
            max_trials=3,
            timeout=120,
            out_dir=str(tmp_path),
            exit_threshold=1.0,
            prompts=[PROMPT],
        )
    except PerfAnalyzerUnavailable as e:
        pytest.skip(f"perf_analyzer cannot run here: {e}")
    for r in report["runs"]:
        assert r["ok"], json.dumps(r, indent=1)
        assert r["response_throughput_per_s"] > r["throughput_infer_per_s"] > 0  # several responses per request
    data = json.loads((tmp_path / "input_data.json").read_text())["data"]
    assert {e["text_input"][0] for e in data} == {PROMPT} and all(e["exit_threshold"] == [1.0] for e in data)


def test_grafana_dashboard_queries_exist_on_metrics_port(server):
    """Every metric that deploy/grafana/ouro-dashboard.json queries (panel `expr`s and the templating
    variables' label_values queries) is exposed on the metrics port of the real server, and so is every
    `stat` label value of ouro_engine_stat / ouro_engine_stat_total it uses; rate() and the like apply to
    counters (and histogram series) only, deriv() and the like to gauges only. Triton's GPU metrics
    (nv_gpu_*), which a CPU server does not have, must be ones Triton 2.51 exposes (TRITON_GPU_METRICS)."""
    with open(os.path.join(ROOT, "deploy", "grafana", "ouro-dashboard.json")) as f:
        dash = json.load(f)
    keywords = {
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "and",
        "or",
        "unless",
        "bool",
        "offset",
        "inf",
        "nan",
    }

    def metric_names(expr: str) -> set[str]:
        e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # label values, quantile strings
        e = re.sub(r"\{[^}]*\}", " ", e)  # label matchers
        e = re.sub(r"\[[^\]]*\]", " ", e)  # ranges and subqueries ([$__rate_interval], [5m:1m])
        e = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)  # label lists
        e = re.sub(r"\boffset\s+-?\w+", " ", e)
        e = re.sub(r"\$\{?\w+\}?", " ", e)  # Grafana variables
        e = re.sub(r"(?<![\w:])(?:0x[0-9a-fA-F]+|\d+(?:\.\d*)?(?:[eE][+-]?\d+)?)", " ", e)  # numbers
        names = re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*(?!\s*\(|[a-zA-Z0-9_:])", e)  # not functions
        return {n for n in names if n.lower() not in keywords}

    def stat_values(expr: str) -> set[tuple[str, str]]:
        """(family, stat) of every ouro_engine_stat / ouro_engine_stat_total selector in `expr`."""
        out: set[tuple[str, str]] = set()
        for family, matchers in re.findall(r"\b(ouro_engine_stat(?:_total)?)\s*\{([^}]*)\}", expr):
            for op, value in re.findall(r'\bstat\s*(=~|=)\s*"([^"]*)"', matchers):
                assert op == "=" or re.fullmatch(r"[\w|]+", value), f"stat=~ regex not a plain alternation: {value}"
                out.update((family, v) for v in value.split("|"))
        return out

    def applied(expr: str) -> set[tuple[str, str]]:
        """(function, metric) for each range function applied straight to a metric selector in `expr`."""
        functions = "|".join(COUNTER_FUNCTIONS + GAUGE_FUNCTIONS)
        return set(re.findall(rf"\b({functions})\s*\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)", expr))

    def panels(items):
        for p in items:
            yield p
            yield from panels(p.get("panels", []))

    used: dict[str, set[str]] = {}  # metric name -> where the dashboard uses it
    stats: dict[tuple[str, str], set[str]] = {}  # (family, stat) -> where
    functions: dict[tuple[str, str], set[str]] = {}  # (function, metric) -> where
    exprs = [
        (f"panel {p['id']} {p['title']!r}", t["expr"])
        for p in panels(dash["panels"])
        for t in p.get("targets", [])
        if t.get("expr")
    ]
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"] if isinstance(var["query"], str) else var["query"]["query"]
            m = re.fullmatch(r"\s*label_values\((.+),\s*\w+\)\s*", query)
            assert m, f"variable {var['name']}: not a label_values(metric, label) query: {query}"
            exprs.append((f"variable ${var['name']}", m.group(1)))
    assert len(exprs) > 20, "the dashboard should have its panels' queries"
    for where, expr in exprs:
        names = metric_names(expr)
        assert names, f"{where}: no metric name found in {expr!r}"
        assert all(re.match(r"(ouro|nv)_", n) for n in names), f"{where}: odd identifiers {names} in {expr!r}"
        for n in names:
            used.setdefault(n, set()).add(where)
        for s in stat_values(expr):
            stats.setdefault(s, set()).add(where)
        for f in applied(expr):
            functions.setdefault(f, set()).add(where)
        if "histogram_quantile" in expr:
            assert re.search(r"_bucket\b", expr), f"{where}: histogram_quantile over no _bucket series: {expr!r}"
    assert {("ouro_engine_stat_total", "rounds"), ("ouro_engine_stat_total", "host_syncs")} <= set(stats), sorted(stats)
    assert {s for f, s in stats if f == "ouro_engine_stat_total"} <= STAT_COUNTERS, "a level read as a counter"
    assert {s for f, s in stats if f == "ouro_engine_stat"} <= STAT_GAUGES, "a count read from the gauge family"
    gpu = {n for n in used if n.startswith("nv_gpu_")}
    assert {"nv_gpu_utilization", "nv_gpu_memory_used_bytes", "nv_gpu_power_usage"} <= gpu, sorted(used)
    assert gpu <= set(TRITON_GPU_METRICS), f"not GPU metrics of Triton 2.51: {gpu - set(TRITON_GPU_METRICS)}"

    # Requests first, so the histograms' and finish reasons' series exist: one through the front (mixed exit
    # depths), one through the ensemble (nv_inference_* of every model).
    r = generate(server.grpc_url, "ouro", PROMPT, all_flags(max_tokens=8, temperature=0.0, exit_threshold=0.7))
    assert r.error is None
    r = generate(
        server.http_url, "ouro_ensemble", PROMPT, request_options(max_tokens=4, temperature=0.0), protocol="http"
    )
    assert r.error is None

    def scrape():
        text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
        samples = re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+\S+", text, re.M)
        types = dict(re.findall(r"^# TYPE (\S+) (\S+)", text, re.M))
        exposed = {name for name, _ in samples}
        have_stats = {
            (name, m.group(1))
            for name, labels in samples
            if name in ("ouro_engine_stat", "ouro_engine_stat_total")
            for m in [re.search(r'stat="([^"]*)"', labels)]
            if m
        }
        gpu_server = any(n.startswith("nv_gpu_") for n in exposed)  # a CPU server has no GPU metrics
        missing = {
            n: sorted(w) for n, w in used.items() if n not in exposed and (gpu_server or not n.startswith("nv_gpu_"))
        }
        missing_stats = {s: sorted(w) for s, w in stats.items() if s not in have_stats}
        return missing, missing_stats, types

    # Published within about 2 x metrics_interval_s (engine process -> ouro_engine -> server).
    wait_for(lambda: scrape()[:2] == ({}, {}), timeout=15)
    missing, missing_stats, types = scrape()
    problems = [f"metric {n} (used by {', '.join(w)})" for n, w in sorted(missing.items())]
    problems += [f'{f}{{stat="{s}"}} (used by {", ".join(w)})' for (f, s), w in sorted(missing_stats.items())]
    assert not problems, (
        f"queried by deploy/grafana/ouro-dashboard.json but not exposed on {server.metrics_url}:\n  "
        + "\n  ".join(problems)
    )
    # Suffixed series belong to a histogram family; plain names are counters or gauges, never a histogram.
    types = {**{n: t for n, t in TRITON_GPU_METRICS.items() if n not in types}, **types}

    def kind(n: str) -> str | None:
        base = re.sub(r"_(bucket|sum|count)$", "", n)
        if base != n and base in types:
            assert types[base] == "histogram", f"{n}: {base} is a {types[base]}, not a histogram"
            return "histogram"
        assert types.get(n) in ("counter", "gauge"), f"{n}: type {types.get(n)}"
        return types[n]

    kinds = {n: kind(n) for n in used}
    wrong = [
        f"{f}({n}) on a {kinds.get(n)} ({', '.join(sorted(w))})"
        for (f, n), w in sorted(functions.items())
        if (f in COUNTER_FUNCTIONS and kinds.get(n) == "gauge")
        or (f in GAUGE_FUNCTIONS and kinds.get(n) in ("counter", "histogram"))
    ]
    assert not wrong, "range functions on the wrong kind of metric:\n  " + "\n  ".join(wrong)
