"""A connection to an engine process (engine_server), and the owner's way to spawn one.

Why a process: inside a Python-backend stub, the engine loop would share one GIL with every request and
response IPC of Triton (each `send()` and `is_cancelled()` is a round trip to the server). In its own
process the engine owns the GPU and steps back to back; the Triton models only parse, route and send.

Who talks to it:
* the owner (the `ouro_engine` model, through engine_pool) spawns it with `start_engine_process` and holds
  a socketpair to it, the owner channel. The engine exits when that channel closes: the owner was
  unloaded, or died (the kernel closes a killed process's end).
* other clients (the `ouro` front) reach its Unix socket with `EngineClient.connect` and send requests
  directly, with no Triton hop in between.

The messages and their order: engine_messages; who may connect: engine_auth.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection

from ..config import ConfigError, EngineConfig
from ..sampling_params import SamplingParams
from .engine_auth import connect, key_path, remove_file, shutdown, write_key
from .engine_errors import EngineProcessError
from .engine_messages import (
    AbortRequest,
    AddRequest,
    CountError,
    EngineInfo,
    FromEngine,
    Hello,
    InitError,
    Ready,
    Start,
    ToEngine,
    recv_message,
    send_message,
)

log = logging.getLogger(__name__)

SERVER_MODULE = "ouro_backend.serving.engine_server"  # run as `python -m SERVER_MODULE`: the engine process


class EngineClient:
    """One connection to the engine process. `on_message(msg)` runs on the reader thread for every message
    after the Hello (or Ready); `on_close()` once when the connection ends. `add` / `abort` /
    `count_error` are thread-safe and raise EngineProcessError once the engine is gone."""

    def __init__(
        self,
        conn: Connection,
        info: EngineInfo,
        on_message: Callable[[FromEngine], None],
        on_close: Callable[[], None],
        name: str = "ouro-engine-client",
    ):
        self.conn = conn
        self.info = info
        self._on_message = on_message
        self._on_close = on_close
        self._send_lock = threading.Lock()
        self.closed = False
        self._reader = threading.Thread(target=self._read, name=name, daemon=True)
        self._reader.start()

    @classmethod
    def connect(
        cls,
        address: str,
        on_message: Callable[[FromEngine], None],
        on_close: Callable[[], None],
        timeout_s: float = 5.0,
        authkey: bytes | None = None,
    ) -> EngineClient:
        """Connect to a running engine process, authenticated with its key (`authkey`, else read from
        `<address>.key`); retries until `timeout_s` (the owner may still be starting it)."""
        deadline = time.monotonic() + timeout_s
        while True:
            conn = None
            try:
                conn = connect(address, authkey)
                hello = recv_message(conn)
                if not isinstance(hello, Hello):
                    raise OSError(f"unexpected first message {type(hello).__name__}")
                return cls(conn, hello.info, on_message, on_close)
            except (OSError, EOFError, AuthenticationError) as e:  # not there yet, restarted, or gone
                if conn is not None:
                    conn.close()
                if time.monotonic() >= deadline:
                    raise EngineProcessError(f"no engine process at {address} ({e or type(e).__name__})") from None
                time.sleep(0.2)

    def add(self, rid: str, prompt_ids: list[int], params: SamplingParams) -> None:
        self._send(AddRequest(rid, prompt_ids, params))

    def abort(self, rid: str) -> None:
        self._send(AbortRequest(rid))

    def count_error(self) -> None:
        self._send(CountError())

    def _send(self, msg: ToEngine) -> None:
        if self.closed:
            raise EngineProcessError("the engine process is gone")
        try:
            with self._send_lock:
                send_message(self.conn, msg)
        except (OSError, ValueError) as e:
            raise EngineProcessError(f"the engine process is gone ({e})") from None

    def _read(self) -> None:
        try:
            while True:
                msg = recv_message(self.conn)
                try:
                    self._on_message(msg)
                except Exception:
                    log.exception("handling %s from the engine process failed", type(msg).__name__)
        except (EOFError, OSError):
            pass
        finally:
            self.closed = True
            self.conn.close()
            self._on_close()

    def close(self) -> None:
        """Shut the connection down; the reader thread sees the end, closes it and calls on_close."""
        self.closed = True
        shutdown(self.conn)
        if threading.current_thread() is not self._reader:
            self._reader.join(timeout=5)


def _python() -> str:
    """The interpreter for the engine process. Inside a Triton stub sys.executable is the stub, not Python;
    the stub's packages come from the `python3` first on PATH (the stub imports through it), so that is the
    one to run."""
    if os.path.basename(sys.executable or "").startswith("python"):
        return sys.executable
    found = shutil.which("python3") or shutil.which("python")
    if not found:
        raise EngineProcessError("no python3 on PATH to run the engine process")
    return found


def start_engine_process(
    config: EngineConfig,
    address: str,
    on_message: Callable[[FromEngine], None],
    on_close: Callable[[], None],
    metrics_interval_s: float = 0.25,
    env: dict[str, str] | None = None,
) -> tuple[EngineClient, subprocess.Popen]:
    """Spawn the engine process (with `env` added to this one's environment), listening at `address`, and
    wait until its engine is built (weights, KV, CUDA graphs). Returns the owner's client and the process.
    Raises ConfigError for a bad config or checkpoint (the engine's message), EngineProcessError if it died."""
    authkey = write_key(address)
    parent, child = socket.socketpair()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # holds ouro_backend/
    env = dict(os.environ, **(env or {}))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen(
        [_python(), "-m", SERVER_MODULE, "--owner-fd", str(child.fileno()), "--address", address],
        pass_fds=[child.fileno()],
        env=env,
    )
    child.close()
    conn = Connection(parent.detach())
    try:
        send_message(conn, Start(config, metrics_interval_s, authkey))
        answer = recv_message(conn)
    except (EOFError, OSError):
        code = proc.wait(timeout=30)
        conn.close()
        remove_file(key_path(address))
        raise EngineProcessError(
            f"the engine process exited with code {code} while starting (its traceback is in the server log)"
        ) from None
    if isinstance(answer, Ready):
        return EngineClient(conn, answer.info, on_message, on_close, name="ouro-engine-owner"), proc
    conn.close()  # an engine that is not ready stops when its owner channel closes, if it has not already
    proc.wait(timeout=30)
    remove_file(key_path(address))
    if isinstance(answer, InitError):
        raise ConfigError(answer.message)
    raise EngineProcessError(f"the engine process answered Start with {type(answer).__name__}")
