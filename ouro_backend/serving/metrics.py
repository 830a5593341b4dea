"""Custom Prometheus metrics of the `ouro_engine` model (Triton's metrics port, `/metrics`).

All families carry the labels `model`, `version`, `engine` (the engine process's index: one per device,
engine_pool) and `device` (`cuda:<i>` or `cpu`). Names (vLLM-like):

  ouro_prompt_tokens_total                 counter    prompt tokens of requests that started generating
  ouro_generation_tokens_total             counter    generated tokens
  ouro_request_success_total{finish_reason} counter   finished requests (stop | length | cancelled)
  ouro_requests_aborted_total              counter    requests cancelled by the client (or the front model)
  ouro_request_errors_total                counter    requests that ended with an error response
  ouro_num_preemptions_total               counter    running requests preempted for lack of KV blocks
  ouro_time_to_first_token_seconds         histogram  arrival -> first token
  ouro_time_per_output_token_seconds       histogram  per request: (finish - first token) / (tokens - 1)
  ouro_e2e_request_latency_seconds         histogram  arrival -> finish
  ouro_exit_depth                          histogram  loop depth at which each generated token exited
  ouro_kv_cache_usage_ratio                gauge      used / total KV blocks (0 when idle)
  ouro_num_requests_running / _waiting /
    _swapped                               gauge      scheduler queues (swapped: preempted, KV in host memory)
  ouro_prefix_cache_hit_rate               gauge      prompt tokens found in the prefix cache / prompt tokens
  ouro_spec_acceptance_rate                gauge      self-speculation: accepted / drafted tokens
  ouro_spec_mean_accepted_length           gauge      self-speculation: tokens per row and step (1 + accepted)
  ouro_engine_stat_total{stat}             counter    the counts of engine.stats() (STAT_COUNTERS: launches,
                                                      rounds, host_syncs, steps...): what each grew by in
                                                      each engine process, added up (rate() applies; a
                                                      restarted engine process keeps the count growing)
  ouro_engine_stat{stat}                   gauge      the other numeric levels of engine.stats()
                                                      (kv_blocks_free, kv_blocks_total, swap_bytes...)
  ouro_server_restarts_total               counter    times ouro-serve's supervisor restarted tritonserver
                                                      before this one ($OURO_SERVER_RESTARTS; labels model,
                                                      version only)

The engine process counts into a `MetricsBuffer` (plain numbers) and sends a `MetricsSnapshot` to the
`ouro_engine` model every `metrics_interval_s`; there a reporter thread publishes it through
pb_utils.MetricFamily (each update is an IPC message to the server, so no hot thread makes them).
"""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from .protocol import finish_reason_name

log = logging.getLogger(__name__)

LATENCY_BUCKETS = [
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
]
TPOT_BUCKETS = [
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
]
GAUGE_KEYS = {
    "kv_usage": "ouro_kv_cache_usage_ratio",
    "num_running": "ouro_num_requests_running",
    "num_waiting": "ouro_num_requests_waiting",
    "num_swapped": "ouro_num_requests_swapped",
    "spec_acceptance_rate": "ouro_spec_acceptance_rate",
    "prefix_cache_hit_rate": "ouro_prefix_cache_hit_rate",
    "spec_mean_accepted_length": "ouro_spec_mean_accepted_length",
}
# The numeric entries of LLMEngine.stats() that only grow while an engine process lives (RunnerStats, the
# engine's counters, the scheduler's preemption counts): published as the counter ouro_engine_stat_total.
STAT_COUNTERS = frozenset(
    {
        "launches",
        "rounds",
        "graph_launches",
        "eager_launches",
        "host_syncs",
        "spec_steps",
        "spec_drafted",
        "spec_accepted",
        "deep_rounds",
        "deep_rows",
        "num_finished",
        "num_aborted",
        "num_failed",
        "prompt_tokens",
        "generation_tokens",
        "steps",
        "num_preemptions",
        "num_recomputes",
    }
)
# Levels (they go up and down) without a family of their own (GAUGE_KEYS): the gauge ouro_engine_stat. A
# numeric entry in neither set is published there too (tests/test_serving_unit.py keeps the sets complete).
STAT_GAUGES = frozenset({"kv_blocks_total", "kv_blocks_free", "prefix_cache_blocks", "swap_bytes"})
RESTARTS_ENV = "OURO_SERVER_RESTARTS"  # set by ouro-serve (entrypoints/supervisor.py) for each server


def server_restarts() -> int:
    try:
        return max(0, int(os.environ.get(RESTARTS_ENV, "0")))
    except ValueError:
        return 0


@dataclass
class MetricsSnapshot:
    counters: Counter = field(default_factory=Counter)  # key of EngineMetrics.counters -> increment
    observations: list = field(default_factory=list)  # (histogram key, value)
    depths: Counter = field(default_factory=Counter)  # exit depth -> generated tokens
    finished: Counter = field(default_factory=Counter)  # finish reason -> requests
    stats: dict | None = None  # LLMEngine.stats(): gauges and engine counters
    stat_counters: Counter = field(default_factory=Counter)  # STAT_COUNTERS key -> what it grew by


# Counters the engine keeps anyway (LLMEngine.counters, in its stats): the Prometheus counter that each feeds.
ENGINE_COUNTERS = {
    "prompt_tokens": "prompt_tokens",
    "generation_tokens": "generation_tokens",
    "num_aborted": "aborted",
    "num_preemptions": "preemptions",
}


class MetricsBuffer:
    """Counts between two snapshots; thread-safe, no Triton."""

    def __init__(self):
        self._lock = threading.Lock()
        self._snap = MetricsSnapshot()
        self._engine_counters = dict.fromkeys(ENGINE_COUNTERS, 0)  # their values at the last take(stats)
        self._stat_counters: dict[str, float] = {}  # STAT_COUNTERS' values at the last take(stats)

    def add(self, key: str, n: int) -> None:
        with self._lock:
            self._snap.counters[key] += n

    def record(self, outputs: list) -> None:
        """What the engine does not count itself, from one step's RequestOutputs: exit depths, finish
        reasons and the latency histograms. One pass and one lock per step: this runs on the step loop."""
        depths: Counter = Counter()
        obs: list = []
        finished: Counter = Counter()
        for out in outputs:
            depths.update(out.new_exit_depths)
            if not out.finished:
                continue
            finished[finish_reason_name(out.finish_reason)] += 1
            if out.first_token_time is not None:
                obs.append(("ttft", out.first_token_time - out.arrival_time))
                if len(out.token_ids) > 1 and out.finish_time is not None:
                    obs.append(("tpot", (out.finish_time - out.first_token_time) / (len(out.token_ids) - 1)))
            if out.finish_time is not None:
                obs.append(("latency", out.finish_time - out.arrival_time))
        with self._lock:
            self._snap.depths.update(depths)
            self._snap.observations.extend(obs)
            self._snap.finished.update(finished)

    def merge(self, snap: MetricsSnapshot) -> None:
        with self._lock:
            self._snap.counters.update(snap.counters)
            self._snap.observations.extend(snap.observations)
            self._snap.depths.update(snap.depths)
            self._snap.finished.update(snap.finished)
            self._snap.stat_counters.update(snap.stat_counters)
            if snap.stats is not None:
                self._snap.stats = snap.stats

    def take(self, stats: dict | None = None) -> MetricsSnapshot:
        """The counts since the last take. With `stats` (LLMEngine.stats()), also what the engine's own
        counters grew by since then (ENGINE_COUNTERS into `counters`, STAT_COUNTERS into `stat_counters`: this
        engine process's counts start at 0, so the first take carries them all)."""
        with self._lock:
            snap, self._snap = self._snap, MetricsSnapshot()
        if stats is not None:
            snap.stats = dict(stats)
            for key, name in ENGINE_COUNTERS.items():
                grown = stats[key] - self._engine_counters[key]
                if grown:
                    snap.counters[name] += grown
                self._engine_counters[key] = stats[key]
            for key in STAT_COUNTERS.intersection(stats):
                grown = stats[key] - self._stat_counters.get(key, 0)
                if grown > 0:
                    snap.stat_counters[key] += grown
                self._stat_counters[key] = stats[key]
        return snap


class EngineMetrics:
    """Queue-and-flush wrapper over pb_utils.MetricFamily; a no-op when pb_utils is None. Each engine
    process of the model has its own series, labelled `engine` (its index) and `device`."""

    def __init__(
        self,
        pb_utils: Any,
        model_name: str,
        model_version: str,
        num_loops: int,
        interval_s: float = 0.25,
        devices: tuple[str, ...] = ("cpu",),
    ):
        self.enabled = pb_utils is not None and hasattr(pb_utils, "MetricFamily")
        self.pending = [MetricsBuffer() for _ in devices]  # per engine: counted, not yet published
        self._stop = threading.Event()
        self.interval_s = interval_s
        if not self.enabled:
            return
        MF = pb_utils.MetricFamily
        has_hist = hasattr(MF, "HISTOGRAM")
        # A Metric is only valid while its MetricFamily object lives: keep every family referenced.
        self._families: list = []

        def family(name: str, desc: str, kind):
            fam = MF(name=name, description=desc, kind=kind)
            self._families.append(fam)
            return fam

        counters = {
            "prompt_tokens": family("ouro_prompt_tokens_total", "Prompt tokens processed", MF.COUNTER),
            "generation_tokens": family("ouro_generation_tokens_total", "Generated tokens", MF.COUNTER),
            "aborted": family("ouro_requests_aborted_total", "Requests cancelled by the client", MF.COUNTER),
            "errors": family("ouro_request_errors_total", "Requests that ended with an error", MF.COUNTER),
            "preemptions": family(
                "ouro_num_preemptions_total", "Running requests preempted for lack of KV blocks", MF.COUNTER
            ),
        }
        hists = (
            {}
            if not has_hist
            else {
                "ttft": (
                    family("ouro_time_to_first_token_seconds", "Time to first token (s)", MF.HISTOGRAM),
                    LATENCY_BUCKETS,
                ),
                "tpot": (
                    family(
                        "ouro_time_per_output_token_seconds", "Time per output token after the first (s)", MF.HISTOGRAM
                    ),
                    TPOT_BUCKETS,
                ),
                "latency": (
                    family("ouro_e2e_request_latency_seconds", "Request latency, arrival to finish (s)", MF.HISTOGRAM),
                    LATENCY_BUCKETS,
                ),
                "depth": (
                    family("ouro_exit_depth", "Loop depth at which generated tokens exited", MF.HISTOGRAM),
                    [float(d) for d in range(1, num_loops + 1)],
                ),
            }
        )
        gauges = {
            key: family(GAUGE_KEYS[key], desc, MF.GAUGE)
            for key, desc in [
                ("kv_usage", "Fraction of KV cache blocks in use"),
                ("num_running", "Requests being generated"),
                ("num_waiting", "Requests waiting for admission"),
                ("num_swapped", "Preempted requests whose KV waits in host memory"),
                (
                    "prefix_cache_hit_rate",
                    "Prompt tokens found in the prefix cache / prompt tokens admitted (0 without prefix caching)",
                ),
                (
                    "spec_acceptance_rate",
                    "Self-speculation: accepted / drafted tokens since start (0 without speculation)",
                ),
                (
                    "spec_mean_accepted_length",
                    "Self-speculation: tokens emitted per row and speculative step (1 + accepted drafts)",
                ),
            ]
        }
        success = family("ouro_request_success_total", "Finished requests by finish reason", MF.COUNTER)
        stat = family("ouro_engine_stat", "Engine levels from LLMEngine.stats() (blocks, bytes)", MF.GAUGE)
        stat_total = family(
            "ouro_engine_stat_total", "Engine counts from LLMEngine.stats() (launches, rounds, steps...)", MF.COUNTER
        )
        # A counter that a new server starts at the count so far: it only grows while ouro-serve runs.
        restarts = family(
            "ouro_server_restarts_total", "tritonserver restarts by ouro-serve before this server", MF.COUNTER
        )
        self._restarts = restarts.Metric(labels={"model": model_name, "version": str(model_version)})
        if server_restarts():
            self._restarts.increment(server_restarts())
        self._series = [
            _Series(
                {"model": model_name, "version": str(model_version), "engine": str(i), "device": device},
                counters,
                hists,
                gauges,
                success,
                stat,
                stat_total,
            )
            for i, device in enumerate(devices)
        ]
        self._thread = threading.Thread(target=self._run, name="ouro-metrics", daemon=True)
        self._thread.start()

    def add(self, key: str, n: int) -> None:
        """Count `n` into counter `key`: what this model finds itself (errors of requests that never reached an
        engine) counts on engine 0's series."""
        if self.enabled:  # nothing would ever take it otherwise
            self.pending[0].add(key, n)

    def merge(self, snap: MetricsSnapshot, engine: int = 0) -> None:
        if self.enabled:
            self.pending[engine].merge(snap)

    # ---- reporter thread ----
    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.flush()
        self.flush()

    def flush(self) -> None:
        if not self.enabled:
            return
        for buffer, series in zip(self.pending, self._series):
            try:
                series.publish(buffer.take())
            except Exception:  # metrics must never take the model down
                log.exception("ouro metrics update failed")

    def close(self) -> None:
        if self.enabled:
            self._stop.set()
            self._thread.join(timeout=5)
            self.enabled = False
            # Metrics before their families (the stub refuses the other order).
            self._series = []
            self._restarts = None
            self._families = []


class _Series:
    """The metrics of one engine process: one label set in every family."""

    def __init__(
        self, labels: dict, counters: dict, hists: dict, gauges: dict, success: Any, stat: Any, stat_total: Any
    ):
        self.labels = labels
        self.counters = {key: fam.Metric(labels=labels) for key, fam in counters.items()}
        self.hists = {key: fam.Metric(labels=labels, buckets=buckets) for key, (fam, buckets) in hists.items()}
        self.gauges = {key: fam.Metric(labels=labels) for key, fam in gauges.items()}
        self._success, self._stat, self._stat_total = success, stat, stat_total
        self._success_metrics: dict[str, Any] = {}
        self._stat_metrics: dict[str, Any] = {}
        self._stat_total_metrics: dict[str, Any] = {}

    def _stat_counter(self, key: str) -> Any:
        m = self._stat_total_metrics.get(key)
        if m is None:
            m = self._stat_total_metrics[key] = self._stat_total.Metric(labels=dict(self.labels, stat=key))
        return m

    def publish(self, snap: MetricsSnapshot) -> None:
        for key, n in snap.counters.items():
            if n:
                self.counters[key].increment(n)
        for key, v in snap.observations:
            h = self.hists.get(key)
            if h is not None:
                h.observe(v)
        depth = self.hists.get("depth")
        if depth is not None:
            for d, n in snap.depths.items():
                for _ in range(n):  # pb_utils histograms observe one value per call
                    depth.observe(float(d))
        for reason, n in snap.finished.items():
            m = self._success_metrics.get(reason)
            if m is None:
                m = self._success_metrics[reason] = self._success.Metric(labels=dict(self.labels, finish_reason=reason))
            m.increment(n)
        for key, n in snap.stat_counters.items():
            self._stat_counter(key).increment(n)
        stats = snap.stats
        if stats:
            for key, gauge in self.gauges.items():
                if key in stats:
                    gauge.set(float(stats[key]))
            for key, value in stats.items():
                if key in self.gauges or isinstance(value, bool) or not isinstance(value, (int, float)):
                    continue
                if key in STAT_COUNTERS:
                    self._stat_counter(key)  # the series exists from the start, at 0 for a count not yet grown
                    continue
                m = self._stat_metrics.get(key)
                if m is None:
                    m = self._stat_metrics[key] = self._stat.Metric(labels=dict(self.labels, stat=key))
                m.set(float(value))
