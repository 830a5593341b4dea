"""Where a served request's time to first token goes: timestamps at each hop, per request (diagnostics).

With `OURO_REQUEST_TRACE=DIR` in the server's environment, the models and the engine processes note when
each request passes each hop (`time.monotonic()`, one clock for every process of the host) and write them to
`DIR/<role>-<pid>.json` when they stop. `summarize(DIR)` joins them by request id and gives the median and
p90 of every hop:

  front      received    execute() has the request            (the front, `ouro`, or `ouro_engine` itself)
             parsed      validated and tokenized
             submitted   handed to the engine process's socket
  engine     received    the engine process read it
             added       LLMEngine.add_request returned
             first_token the host collected its first token (the step's readback)
             routed      that token went out on the socket (during the next step: `EngineServer.serve`)
  front      delivered   the front's reader thread filed it
             responded   the sender's send() of the response that carries it returned

The client's own hops (its send, the server's gRPC front, the response's way back) are the rest of the
TTFT that a client measures. `benchmarks/served.py --trace` sets the variable and reports the summary.
"""
from __future__ import annotations

import glob
import json
import os
import statistics
import threading
import time
from typing import Optional

ENV = "OURO_REQUEST_TRACE"
HOPS = [("front", "received"), ("front", "parsed"), ("front", "submitted"), ("engine", "received"),
        ("engine", "added"), ("engine", "first_token"), ("engine", "routed"), ("front", "delivered"),
        ("front", "responded")]


class RequestTrace:
    """One process's marks: request id -> {event: first time}. Thread-safe; cheap enough for the hot path
    only while tracing (callers hold None otherwise)."""

    def __init__(self, directory: str, role: str):
        self.directory, self.role = directory, role
        self._marks: dict[str, dict[str, float]] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls, role: str) -> Optional["RequestTrace"]:
        directory = os.environ.get(ENV)
        return cls(directory, role) if directory else None

    def mark(self, rid: str, event: str, when: Optional[float] = None) -> None:
        """The first time `rid` passes `event` (later passes keep the first)."""
        t = time.monotonic() if when is None else when
        with self._lock:
            self._marks.setdefault(rid, {}).setdefault(event, t)

    def write(self) -> str:
        os.makedirs(self.directory, exist_ok=True)
        path = os.path.join(self.directory, f"{self.role}-{os.getpid()}.json")
        with self._lock:
            marks = dict(self._marks)
        with open(path, "w") as f:
            json.dump(dict(role=self.role, marks=marks), f)
        return path


def summarize(directory: str) -> dict:
    """{hop "a -> b": {median_ms, p90_ms, n}} over the requests every hop of which was seen, and `ttft_ms`
    (front received -> front responded)."""
    by_rid: dict[str, dict[str, float]] = {}
    for path in glob.glob(os.path.join(directory, "*.json")):
        with open(path) as f:
            d = json.load(f)
        for rid, marks in d["marks"].items():
            slot = by_rid.setdefault(rid, {})
            for event, t in marks.items():
                slot[f"{d['role']}.{event}"] = t
    names = [f"{role}.{event}" for role, event in HOPS]
    complete = [m for m in by_rid.values() if all(n in m for n in names)]
    out: dict = {"requests": len(complete)}
    if not complete:
        return out

    def stats(values: list[float]) -> dict:
        values = sorted(v * 1e3 for v in values)
        return dict(median_ms=round(statistics.median(values), 3),
                    p90_ms=round(values[min(len(values) - 1, int(0.9 * len(values)))], 3))

    for a, b in zip(names, names[1:]):
        out[f"{a} -> {b}"] = stats([m[b] - m[a] for m in complete])
    out["ttft_ms"] = stats([m[names[-1]] - m[names[0]] for m in complete])
    return out
