"""The OpenAI-compatible API (entrypoints/openai_api.py) as a child process of `ouro-serve --openai-port`:
its port checked before anything starts, the process started beside tritonserver, watched and started
again if it dies, and stopped with ouro-serve. Nothing here imports FastAPI: ouro-serve stays light."""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from .tritonserver import ServerError, TritonServer, bind_error, parent_death_wrapper


def check_openai(server: TritonServer, port: int) -> None:
    """ServerError if the API could not run: FastAPI or uvicorn missing, or it could not listen on `port` at
    `server`'s address (one of tritonserver's ports, or in use: naming the process that holds it, as
    TritonServer.check_ports does)."""
    missing = [name for name in ("fastapi", "uvicorn", "jinja2") if importlib.util.find_spec(name) is None]
    if missing:
        raise ServerError(
            f"--openai-port needs {', '.join(missing)}: pip install 'ouro-triton[serve]' (or {' '.join(missing)})"
        )
    for _, option, p in server.endpoints():
        if p == port:
            raise ServerError(f"--openai-port {port}: the same port as {option}; give each endpoint its own port")
    error = bind_error(server.bind_address, port)
    if error is None:
        return
    if error.errno == errno.EADDRINUSE:
        raise ServerError(server._port_in_use("OpenAI API", "--openai-port", port))
    raise ServerError(f"cannot listen on OpenAI API port {port} (--openai-port) on {server.bind_address}: {error}")


class OpenAIServer:
    """The API in a process of its own beside tritonserver, kept across tritonserver's restarts (each request
    opens its own stream). A watcher thread starts it, and starts it again when it dies (after 1 s, doubling
    up to 30 s while it dies within 60 s of its start), saying so on stderr; it gets SIGTERM when ouro-serve
    stops, and when ouro-serve dies (setpriv --pdeathsig, where util-linux has it: the watcher thread, which
    starts it, lives as long as ouro-serve). Its output: the server log's path + `.openai-api`."""

    def __init__(self, server: TritonServer, address: str, port: int):
        self.host, self.port = server.host, port
        self.url = f"{server.host}:{port}"
        self.log_file = f"{server.log_file}.openai-api"
        self.cmd = [
            *parent_death_wrapper(),
            sys.executable,
            "-m",
            "ouro_backend.entrypoints.openai_api",
            "--grpc-url",
            server.grpc_url,
            "--model",
            str(server.model),
            "--host",
            address,
            "--port",
            str(port),
        ]
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self._started = threading.Event()
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="openai-api", daemon=True)
        self._watcher.start()
        self._started.wait()

    def _spawn(self) -> subprocess.Popen[bytes]:
        with open(self.log_file, "ab") as log_handle:
            self.starts += 1
            # A session of its own: a terminal's Ctrl-C reaches ouro-serve, which stops it (stop()).
            return subprocess.Popen(
                self.cmd, stdout=log_handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )

    def _watch(self) -> None:
        backoff = 1.0
        self.proc, started = self._spawn(), time.monotonic()
        self._started.set()
        while not self._stop.wait(0.5):
            proc = self.proc
            if proc.poll() is None:
                continue
            if time.monotonic() - started >= 60:  # it had run a while: not a crash loop
                backoff = 1.0
            print(
                f"ouro-serve: the OpenAI API (pid {proc.pid}) exited with code {proc.returncode}; starting it "
                f"again in {backoff:.0f} s (log {self.log_file})",
                file=sys.stderr,
                flush=True,
            )
            if self._stop.wait(backoff):
                return
            self.proc, started = self._spawn(), time.monotonic()
            backoff = min(backoff * 2, 30.0)

    def answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.url}/v1/models", timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def wait_answering(self, timeout_s: float = 60.0) -> None:
        """Until /v1/models answers; ServerError (with the log's tail) if it does not within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while not self.answers():
            proc = self.proc
            if (proc is not None and proc.poll() is not None and self.starts == 1) or time.monotonic() > deadline:
                tail = Path(self.log_file).read_text(errors="replace")[-3000:]
                raise ServerError(f"the OpenAI API did not start (log {self.log_file}):\n{tail}")
            time.sleep(0.1)

    def begin_stop(self) -> None:
        """SIGTERM (uvicorn's graceful shutdown: requests in flight get 5 s); it is not started again. Safe in
        a signal handler."""
        self._stop.set()
        proc = self.proc
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)

    def stop(self, grace_s: float = 10.0) -> None:
        """begin_stop() once the watcher has ended (so no new process follows), then SIGKILL after `grace_s`."""
        self._stop.set()
        self._watcher.join()
        self.begin_stop()
        proc = self.proc
        if proc is not None:
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
