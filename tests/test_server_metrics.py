"""Metrics through a real tritonserver: the Prometheus metrics, perf_analyzer against the server, and every
query of the Grafana dashboard.

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

pytestmark = pytest.mark.timeout(300)


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
    `stat` label value of ouro_engine_stat it uses."""
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

    def stat_values(expr: str) -> set[str]:
        out: set[str] = set()
        for matchers in re.findall(r"\bouro_engine_stat\s*\{([^}]*)\}", expr):
            for op, value in re.findall(r'\bstat\s*(=~|=)\s*"([^"]*)"', matchers):
                assert op == "=" or re.fullmatch(r"[\w|]+", value), f"stat=~ regex not a plain alternation: {value}"
                out.update(value.split("|"))
        return out

    def panels(items):
        for p in items:
            yield p
            yield from panels(p.get("panels", []))

    used: dict[str, set[str]] = {}  # metric name -> where the dashboard uses it
    stats: dict[str, set[str]] = {}
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
        if "histogram_quantile" in expr:
            assert re.search(r"_bucket\b", expr), f"{where}: histogram_quantile over no _bucket series: {expr!r}"
    assert "ouro_engine_stat" in used and {"rounds", "host_syncs"} <= set(stats), (sorted(used), sorted(stats))

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
            m.group(1)
            for name, labels in samples
            if name == "ouro_engine_stat"
            for m in [re.search(r'stat="([^"]*)"', labels)]
            if m
        }
        missing = {n: sorted(w) for n, w in used.items() if n not in exposed}
        missing_stats = {s: sorted(w) for s, w in stats.items() if s not in have_stats}
        return missing, missing_stats, types

    # Published within about 2 x metrics_interval_s (engine process -> ouro_engine -> server).
    wait_for(lambda: scrape()[:2] == ({}, {}), timeout=15)
    missing, missing_stats, types = scrape()
    problems = [f"metric {n} (used by {', '.join(w)})" for n, w in sorted(missing.items())]
    problems += [f'ouro_engine_stat{{stat="{s}"}} (used by {", ".join(w)})' for s, w in sorted(missing_stats.items())]
    assert not problems, (
        f"queried by deploy/grafana/ouro-dashboard.json but not exposed on {server.metrics_url}:\n  "
        + "\n  ".join(problems)
    )
    # Suffixed series belong to a histogram family; plain names are counters or gauges, never a histogram.
    for n in used:
        base = re.sub(r"_(bucket|sum|count)$", "", n)
        if base != n and base in types:
            assert types[base] == "histogram", f"{n}: {base} is a {types[base]}, not a histogram"
        else:
            assert types.get(n) in ("counter", "gauge"), f"{n}: type {types.get(n)}"
