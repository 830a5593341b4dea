"""Small helpers several test modules share (imported as `helpers`: pytest puts tests/ on sys.path)."""

from __future__ import annotations

import os
import queue
import sys
import time
from collections.abc import Iterator


def wait_for(predicate, timeout: float = 15.0, interval: float = 0.1):
    """Poll `predicate` until it returns something true or `timeout` passes; returns its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()


def processes() -> Iterator[tuple[int, list[bytes]]]:
    """(pid, argv) of every process this user can see, from /proc."""
    from ouro_backend.entrypoints.procfs import process_argv

    for entry in os.listdir("/proc"):
        if entry.isdigit() and (argv := process_argv(int(entry))) is not None:
            yield int(entry), argv


def find_engine_process(address_part: str, known=frozenset()) -> int:
    """The pid of an engine process (`python -m ouro_backend.serving.engine_server`) whose --address
    contains `address_part`, other than those in `known`; 0 when there is none."""
    from ouro_backend.serving.engine_client import SERVER_MODULE

    for pid, argv in processes():
        if pid not in known and SERVER_MODULE.encode() in argv and any(address_part.encode() in a for a in argv):
            return pid
    return 0


class Inbox:
    """Collects the messages of one engine-process connection (EngineClient's on_message / on_close);
    `pump(until)` files them until `until()` holds. A request that Failed must get no output after it."""

    def __init__(self):
        self.q: queue.Queue = queue.Queue()
        self.closed = False
        self.tokens: dict[str, list] = {}
        self.depths: dict[str, list] = {}
        self.reasons: dict[str, str] = {}
        self.rejected: dict[str, str] = {}
        self.failed: dict[str, str] = {}
        self.stats: list = []

    def on_message(self, msg):
        self.q.put(msg)

    def on_close(self):
        self.closed = True

    def pump(self, until, timeout=120.0):
        from ouro_backend.serving.engine_messages import Failed, Outputs, Rejected, Stats

        deadline = time.monotonic() + timeout
        while not until():
            match self.q.get(timeout=max(0.01, deadline - time.monotonic())):
                case Outputs(deltas):
                    for d in deltas:
                        assert d.rid not in self.failed, f"{d.rid}: an output after its failure"
                        self.tokens.setdefault(d.rid, []).extend(d.ids)
                        self.depths.setdefault(d.rid, []).extend(d.depths)
                        if d.finish_reason is not None:
                            self.reasons[d.rid] = d.finish_reason
                case Rejected(rid, message):
                    self.rejected[rid] = message
                case Failed(rids, message):
                    for rid in rids:
                        self.failed[rid] = message
                case Stats(snapshot):
                    self.stats.append(snapshot)


def read_until_ready(proc, log_path, timeout: float = 240.0) -> str:
    """The output of an `ouro-serve` started with stdout=PIPE (text) up to its "ouro-serve: ready" line;
    fails with that output and the server log's tail if it ends or times out first."""
    lines = []
    deadline = time.time() + timeout
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if "ouro-serve: ready" in line:
            break
    out = "".join(lines)
    log = log_path.read_text(errors="replace")[-3000:] if log_path.exists() else "(no log)"
    assert "ouro-serve: ready" in out, out + log
    return out


def ouro_serve_cmd(model: str | None, log: str, http: int, grpc: int, metrics: int, *extra: str) -> list[str]:
    """`ouro-serve` on 127.0.0.1 and these ports, CPU fp32, logging to `log`; model None: its default (the
    demo model, when $OURO_MODEL_PATH is unset)."""
    return [
        sys.executable,
        "-m",
        "ouro_backend.entrypoints.serve",
        *(["--model", model] if model else []),
        "--address",
        "127.0.0.1",
        "--http-port",
        str(http),
        "--grpc-port",
        str(grpc),
        "--metrics-port",
        str(metrics),
        "--devices",
        "cpu",
        "--engine-arg",
        "device=cpu",
        "--engine-arg",
        "dtype=float32",
        "--log-file",
        log,
        *extra,
    ]
