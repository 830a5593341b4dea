"""Where a served request's time to first token goes: timestamps at each hop, per request (diagnostics).

With `OURO_REQUEST_TRACE=DIR` in the server's environment, the models and the engine processes note when
each request passes each hop (`time.monotonic()`, one clock for every process of the host) and write them to
`DIR/<role>-<pid>.json` when they stop. `summarize(DIR)` joins them by request id and gives the median and
p90 of every hop:

  client     sent        just before the client sent it       (client/load.py, with the variable set)
  front      received    execute() has the request            (the front, `ouro`, or `ouro_engine` itself)
             parsed      validated and tokenized
             submitted   about to be written to the engine process's socket
  engine     received    the engine process read it
             added       LLMEngine.add_request returned
             first_token the host collected its first token (the step's readback)
             routed      that token went out on the socket (during the next step: `EngineServer.serve`)
  front      delivered   the front's reader thread filed it
             responded   the sender's send() of the response that carries it returned
  client     received    the client's stream callback had that response (it can come before `responded`:
                         send() returns once the server has the response and this thread has the GIL)

client -> front is Triton's way in (gRPC, the server's queue, the IPC to the Python stub and its execute
call); front responded -> client received is the way out. The front knows a client's marks by the request
id the client sent (`alias`). Without client marks the summary spans front received -> front responded.
`benchmarks/served.py --trace` sets the variable (for the server and load.py) and reports the summary.
"""

from __future__ import annotations

import glob
import json
import os
import statistics
import threading
import time

ENV = "OURO_REQUEST_TRACE"
HOPS = [
    ("client", "sent"),
    ("front", "received"),
    ("front", "parsed"),
    ("front", "submitted"),
    ("engine", "received"),
    ("engine", "added"),
    ("engine", "first_token"),
    ("engine", "routed"),
    ("front", "delivered"),
    ("front", "responded"),
    ("client", "received"),
]


class RequestTrace:
    """One process's marks: request id -> {event: first time}. Thread-safe; cheap enough for the hot path
    only while tracing (callers hold None otherwise)."""

    def __init__(self, directory: str, role: str):
        self.directory, self.role = directory, role
        self._marks: dict[str, dict[str, float]] = {}
        self._aliases: dict[str, str] = {}  # another process's id of a request -> ours
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls, role: str) -> RequestTrace | None:
        directory = os.environ.get(ENV)
        return cls(directory, role) if directory else None

    def mark(self, rid: str, event: str, when: float | None = None) -> None:
        """The first time `rid` passes `event` (later passes keep the first)."""
        t = time.monotonic() if when is None else when
        with self._lock:
            self._marks.setdefault(rid, {}).setdefault(event, t)

    def alias(self, other: str, rid: str) -> None:
        """`other` (the id a client sent with the request) names request `rid` in other processes' marks."""
        with self._lock:
            self._aliases[other] = rid

    def write(self) -> str:
        os.makedirs(self.directory, exist_ok=True)
        path = os.path.join(self.directory, f"{self.role}-{os.getpid()}.json")
        with self._lock:
            marks, aliases = dict(self._marks), dict(self._aliases)
        with open(path, "w") as f:
            json.dump(dict(role=self.role, marks=marks, aliases=aliases), f)
        return path


def load(directory: str) -> dict[str, dict]:
    """The trace files of `directory` by path: {"role", "marks": {request id: {event: time}}, "aliases"}."""
    files = {}
    for path in glob.glob(os.path.join(directory, "*.json")):
        with open(path) as f:
            files[path] = json.load(f)
    return files


def canonical_ids(files: dict[str, dict]) -> dict[str, str]:
    """Another process's id of a request -> the id its marks are joined under."""
    return {k: v for d in files.values() for k, v in d.get("aliases", {}).items()}


def join(files: dict[str, dict]) -> dict[str, dict[str, float]]:
    """Every request's marks across the processes: {request id: {"role.event": time}}."""
    aliases = canonical_ids(files)
    by_rid: dict[str, dict[str, float]] = {}
    for d in files.values():
        for rid, marks in d["marks"].items():
            slot = by_rid.setdefault(aliases.get(rid, rid), {})
            for event, t in marks.items():
                slot[f"{d['role']}.{event}"] = t
    return by_rid


def summarize(directory: str) -> dict:
    """{hop "a -> b": {median_ms, p90_ms}} over the requests every hop of which was seen, and `ttft_ms`
    (first hop -> last: client sent -> client received when a client left marks, else front received ->
    front responded)."""
    files = load(directory)
    by_rid = join(files)
    roles = {d["role"] for d in files.values()}
    names = [f"{role}.{event}" for role, event in HOPS if role in roles]
    complete = [m for m in by_rid.values() if all(n in m for n in names)]
    out: dict = {"requests": len(complete)}
    if not complete:
        return out

    def stats(values: list[float]) -> dict:
        values = sorted(v * 1e3 for v in values)
        return dict(
            median_ms=round(statistics.median(values), 3),
            p90_ms=round(values[min(len(values) - 1, int(0.9 * len(values)))], 3),
        )

    for a, b in zip(names, names[1:]):
        out[f"{a} -> {b}"] = stats([m[b] - m[a] for m in complete])
    out["ttft_ms"] = stats([m[names[-1]] - m[names[0]] for m in complete])
    return out
