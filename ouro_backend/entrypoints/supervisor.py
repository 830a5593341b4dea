"""Keeping a tritonserver serving (`Supervisor`, what `ouro-serve` runs).

Triton 2.51 dies on some inputs (the SIGSEGV it takes on a form-encoded POST body of ~4 MB or more) and
never restarts a Python backend stub that dies while it lives on (its clients would hang and about half
of the new requests fail while /v2/health/ready says 200). So when tritonserver dies without being asked
to (a signal, any exit code), or one of its stubs does, the supervisor kills what is left of its process
group, removes the files it left (TritonServer.kill), logs the exit code and the log tail, and starts it
again: after `backoff_s` (1 s), doubling up to `max_backoff_s` (30 s) for a server that crashes again
within `stable_s` (60 s) of being ready. A start that does not reach readiness counts as failed; after
`max_failed_starts` (5) in a row it gives up. The first start is not retried: if it fails, the
configuration is the problem. Each server gets the restart count
in $OURO_SERVER_RESTARTS (published as `ouro_server_restarts_total`). Stubs are watched only without
model control (`--model-control-mode` none), where a stub that goes away was not unloaded.

Readiness is this server's only: a port that another process listens on fails the start at once
(TritonServer.check_ports before it, port_conflict while it loads), and /v2/health/ready counts only when
this tritonserver holds the HTTP port (TritonServer.is_ready), so a second ouro-serve started on ports in
use says so and exits 1 instead of taking the first server's answers for its own.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable

from ..serving.metrics import RESTARTS_ENV
from .procfs import child_stubs
from .tritonserver import ServerError, TritonServer


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"code {code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"code {code}"
    return f"code {code}"


class Supervisor:
    """Keeps `server` serving until request_stop(): starts it, waits for readiness, watches it, and restarts
    it when it dies or one of its Python backend stubs does (the module docstring). run() returns the
    exit code for ouro-serve: 0 once stopped on request, 1 when the first start fails or after
    `max_failed_starts` failed starts in a row (or, with restart=False, when the server dies).

    Thread-safe to stop from a signal handler or another thread. `restarts` counts restarts so far (each
    server gets it in $OURO_SERVER_RESTARTS); `recoveries` holds, per restart that reached readiness, the
    seconds from noticing the death to ready again; `ready` is set while a server is ready."""

    def __init__(
        self,
        server: TritonServer,
        ready_timeout: float = 600.0,
        max_failed_starts: int = 5,
        backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        stable_s: float = 60.0,
        stop_grace_s: float = 10.0,
        restart: bool = True,
        poll_s: float = 0.5,
        on_ready: Callable[[Supervisor], None] | None = None,
        log: Callable[[str], None] = lambda text: print(text, file=sys.stderr, flush=True),
    ):
        self.server = server
        self.ready_timeout, self.max_failed_starts = ready_timeout, max(1, max_failed_starts)
        self.backoff_s, self.max_backoff_s, self.stable_s = backoff_s, max_backoff_s, stable_s
        self.stop_grace_s, self.restart, self.poll_s = stop_grace_s, restart, poll_s
        self.on_ready, self.log = on_ready, log
        self.restarts = 0
        self.recoveries: list[float] = []
        self.ready = threading.Event()
        self._stop = threading.Event()
        self._hurry = threading.Event()
        self.stop_reason = ""
        # Under model control (explicit/poll) a stub may go away because its model was unloaded.
        mode = server.user_arg("--model-control-mode")
        self.watch_stubs = mode in (None, "none")

    def request_stop(self, reason: str = "") -> None:
        """Stop gracefully; a second call kills the server without waiting for the grace. Safe in a signal
        handler (it only sets events: run() says `reason`)."""
        if self._stop.is_set():
            self._hurry.set()
        self.stop_reason = self.stop_reason or reason
        self._stop.set()

    def _wait_ready(self) -> str | None:
        """None once ready (or stopping); else why the start failed."""
        deadline = time.monotonic() + self.ready_timeout
        proc = self.server.proc
        while not self._stop.is_set():
            if proc.poll() is not None:
                return f"tritonserver exited with {_describe_exit(proc.returncode)} before it was ready"
            conflict = self.server.port_conflict()
            if conflict is not None:  # it cannot open that port: it would load its models, then exit
                return conflict
            if self.server.is_ready():
                self.server.mark_ready()
                return None
            if time.monotonic() > deadline:
                return f"tritonserver not ready after {self.ready_timeout:.0f} s"
            self._stop.wait(0.25)
        return None

    def _watch(self) -> str | None:
        """Block while the ready server lives; why it is dead (None: stop requested)."""
        proc = self.server.proc
        stubs = self.server.stubs() if self.watch_stubs else {}
        while not self._stop.wait(self.poll_s):
            if proc.poll() is not None:
                return f"tritonserver (pid {proc.pid}) exited with {_describe_exit(proc.returncode)}"
            if not stubs:
                continue
            now = child_stubs(proc.pid)
            if proc.poll() is not None:  # its stubs go with it: that is the exit above
                continue
            dead = [(pid, model) for pid, (start, model) in stubs.items() if now.get(pid, (None,))[0] != start]
            if dead:
                pid, model = dead[0]
                return (
                    f"the Python backend stub of model '{model}' (pid {pid}) died; tritonserver (pid "
                    f"{proc.pid}) does not restart it and cannot serve that model instance"
                )
            stubs.update(now)
        return None

    def run(self) -> int:
        try:
            return self._run()
        except BaseException:
            self.server.kill()  # never leave a server behind
            raise

    def _run(self) -> int:
        failed, backoff, served = 0, self.backoff_s, False
        down_at: float | None = None
        while not self._stop.is_set():
            self.server.extra_env[RESTARTS_ENV] = str(self.restarts)
            try:
                self.server.start(wait=False)
            except (ServerError, OSError) as e:
                self.log(f"ouro-serve: {e}")
                self.server.kill()
                return 1
            why = self._wait_ready()
            if self._stop.is_set():
                break
            if why is not None:
                failed += 1
                self.server.kill()
                tail = self.server.log_tail()
                if not served:  # never served: the configuration, not a crash
                    self.log(f"ouro-serve: {why}; log {self.server.log_file}:\n{tail}")
                    return 1
                if failed >= self.max_failed_starts or not self.restart:
                    self.log(
                        f"ouro-serve: {why}; log {self.server.log_file}:\n{tail}\nouro-serve: giving up: "
                        f"{failed} restart(s) in a row did not reach readiness (--max-failed-starts)"
                    )
                    return 1
                self.log(
                    f"ouro-serve: {why} (failed start {failed} of at most {self.max_failed_starts}); "
                    f"restart {self.restarts + 1} in {backoff:.0f} s; log {self.server.log_file}:\n{tail}"
                )
            else:
                served, failed = True, 0
                ready_at = time.monotonic()
                if down_at is not None:
                    self.recoveries.append(ready_at - down_at)
                self.ready.set()
                if self.on_ready is not None:
                    self.on_ready(self)
                why = self._watch()
                self.ready.clear()
                if why is None:
                    break
                down_at = time.monotonic()
                code = self.server.kill()
                tail = self.server.log_tail()
                self.server.note(f"{why}; killed its process group (exit {_describe_exit(code)}), removed its files")
                if not self.restart:
                    self.log(f"ouro-serve: {why}; log {self.server.log_file}:\n{tail}")
                    return 1
                if time.monotonic() - ready_at >= self.stable_s:
                    backoff = self.backoff_s
                self.log(
                    f"ouro-serve: {why}; restart {self.restarts + 1} in {backoff:.0f} s; "
                    f"log {self.server.log_file}:\n{tail}"
                )
            self.restarts += 1
            delay, backoff = backoff, min(backoff * 2, self.max_backoff_s)
            if self._stop.wait(delay):
                break
            self.server.note(f"restart {self.restarts}")
        self.ready.clear()
        if self.stop_reason:
            self.log(f"ouro-serve: {self.stop_reason}: stopping tritonserver")
        code = self.server.stop(self.stop_grace_s, self._hurry)
        if code not in (0, None):
            self.log(f"ouro-serve: tritonserver ended with {_describe_exit(code)} while stopping")
        return 0
