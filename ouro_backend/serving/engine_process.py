"""The engine in a process of its own, reached over sockets (the shape of vLLM V1's EngineCore).

Why a process: inside a Python-backend stub, the engine loop would share one GIL with every request and
response IPC of Triton (each `send()` and `is_cancelled()` is a round trip to the server). Here the child
owns the GPU and runs `LLMEngine.step()` back to back; the Triton models only parse, route and send.

Who talks to it:
* the owner (the `ouro_engine` model) spawns it and holds a socketpair to it. That channel carries the
  engine config, the connection key, the start-up result, the owner's own requests and the engine's
  metrics. The child exits when it closes: the owner was unloaded, or died (the kernel closes a killed
  process's end).
* other clients (the `ouro` front) connect to its Unix socket at `address` and send requests directly,
  with no Triton hop in between.

Security: what crosses the socket is pickled, so a peer that gets in could run code as the server's user.
The socket lives in `<tmp>/ouro-triton-<uid>/`, which must be a directory of this user that no one else
can enter (`private_dir` refuses anything else), and every connection must prove it holds the engine's
secret key (multiprocessing's HMAC challenge, both ways) before a single message is unpickled. The owner
draws the key, hands it to the child over the owner channel and leaves it, readable by this user only,
in `<address>.key`, where the other models of the same server read it.

Messages (pickled by multiprocessing.connection), in order per connection:
  client -> engine   ("add", rid, prompt_ids, SamplingParams)   ("abort", rid)
                     ("error",)   the client answered a request with an error of its own (for the metrics)
  engine -> client   ("hello", EngineInfo)                       on connect (on the owner channel: "ready")
                     ("outputs", [Delta, ...], Load)             after each step that moved its requests
                     ("load", Load)                              every `metrics_interval_s` (for routing:
                                                                 engine_pool.EngineRouter)
                     ("rejected", rid, message, kind)            add_request refused it: kind "invalid" (a
                                                                 RequestError) or "busy" (over capacity)
                     ("failed", [rid, ...], message)             the engine ended these requests with an error
                                                                 (each one's own, or their launch's); they are gone
  engine -> owner    ("stats", MetricsSnapshot)                  every `metrics_interval_s`
                     ("init_error", message)                     instead of "ready" when start-up failed
"""
from __future__ import annotations

import argparse
import logging
import os
import secrets
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener, answer_challenge, deliver_challenge
from typing import Callable, NamedTuple, Optional

from ..config import ConfigError, EngineConfig
from ..engine.round_trace import RoundTrace
from ..sampling_params import RequestError, SamplingParams
from .metrics import MetricsBuffer
from .request_trace import RequestTrace

log = logging.getLogger(__name__)


class Delta(NamedTuple):
    """What one step produced for one request: new tokens (and the few before them, for stateless
    detokenization) and, on the last one, the finish reason and the characters a stop string cuts."""
    rid: str
    ids: list
    depths: list
    prefix: list
    trim: int
    finish_reason: Optional[str]
    spec_counts: tuple[int, int] = (0, 0)  # self-speculation: the request's (drafted, accepted) so far
    num_cached: int = 0  # prompt tokens whose KV came from the prefix cache


class Load(NamedTuple):
    """How busy an engine is, for clients that choose between engines."""
    requests: int  # running + waiting + swapped
    kv_usage: float  # used / total KV blocks


@dataclass(frozen=True)
class EngineInfo:
    model_path: str
    device: str
    dtype: str
    num_loops: int
    max_model_len: int
    kv_blocks: int
    pid: int
    # The serving limits of its EngineConfig, which the Triton models enforce (serving/streams.py).
    max_num_seqs: int
    max_waiting_requests: int
    request_timeout_s: float

    @property
    def capacity(self) -> int:
        """Requests it may hold (running + waiting) before new ones are refused as busy."""
        return self.max_num_seqs + self.max_waiting_requests


class EngineProcessError(RuntimeError):
    """The engine process could not start, or is gone."""


class ServerBusy(RequestError):
    """A request refused because the engine already holds as many as it may (EngineInfo.capacity)."""


def _shutdown(conn: Connection) -> None:
    """Wake a thread blocked reading `conn` (closing the fd alone would not)."""
    try:
        sock = socket.socket(fileno=conn.fileno())
        sock.shutdown(socket.SHUT_RDWR)
        sock.detach()
    except (OSError, ValueError):
        pass


HANDSHAKE_TIMEOUT_S = 5.0  # a peer that connects and does not answer the challenge is cut off after this


def private_dir() -> str:
    """`<tmp>/ouro-triton-<uid>`, created 0700 if missing. Refused unless it is a real directory owned by
    this user that no one else can enter: another user who made it first (or can write to it) could put
    their own socket in the engine's place or connect to it."""
    uid = os.getuid()
    directory = os.path.join(tempfile.gettempdir(), f"ouro-triton-{uid}")
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode):
        raise EngineProcessError(f"{directory} is not a directory (a link or a file is in its place); "
                                 f"remove it, or set TMPDIR to another directory")
    if st.st_uid != uid:
        raise EngineProcessError(f"{directory} belongs to uid {st.st_uid}, not to this user (uid {uid}): another "
                                 f"user could control the engine's socket; remove it, or set TMPDIR")
    if st.st_mode & 0o077:
        raise EngineProcessError(f"{directory} is accessible by other users (mode {stat.S_IMODE(st.st_mode):o}); "
                                 f"run 'chmod 700 {directory}' or remove it")
    return directory


def engine_address(engine_model: str, server_pid: int) -> str:
    """The socket of the engine owned by model `engine_model` in the tritonserver with pid `server_pid`:
    deterministic, so another model of the same server finds it; in `private_dir()`."""
    return os.path.join(private_dir(), f"engine-{server_pid}-{engine_model}.sock")


def key_path(address: str) -> str:
    return address + ".key"


def write_key(address: str) -> bytes:
    """A fresh secret for the engine at `address`, left in `<address>.key` (0600, this user's)."""
    key = secrets.token_bytes(32)
    path = key_path(address)
    _remove(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key)
    return key


def _remove(path: str) -> None:
    if os.path.lexists(path):
        os.unlink(path)


def read_key(address: str) -> bytes:
    """The secret of the engine at `address`; OSError while there is none (the owner may be starting it)."""
    fd = os.open(key_path(address), os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise EngineProcessError(f"{key_path(address)} is not private to this user; refusing to use it")
        return f.read()


# ------------------------------------------------------------------------------------------ client side
class EngineClient:
    """One connection to the engine process. `on_message(msg)` runs on the reader thread for every message
    after the hello; `on_close()` once when the connection ends. `add` / `abort` are thread-safe."""

    def __init__(self, conn: Connection, info: EngineInfo, on_message: Callable[[tuple], None],
                 on_close: Callable[[], None], name: str = "ouro-engine-client"):
        self.conn = conn
        self.info = info
        self._on_message = on_message
        self._on_close = on_close
        self._send_lock = threading.Lock()
        self.closed = False
        self._reader = threading.Thread(target=self._read, name=name, daemon=True)
        self._reader.start()

    @classmethod
    def connect(cls, address: str, on_message, on_close, timeout_s: float = 5.0,
                authkey: Optional[bytes] = None) -> "EngineClient":
        """Connect to a running engine process, authenticated with its key (`authkey`, else read from
        `<address>.key`); retries until `timeout_s` (the owner may still be starting it)."""
        deadline = time.monotonic() + timeout_s
        while True:
            conn = None
            try:
                conn = Client(address, family="AF_UNIX", authkey=authkey if authkey is not None else read_key(address))
                kind, info = conn.recv()
                if kind != "hello":
                    raise OSError(f"unexpected first message {kind!r}")
                return cls(conn, info, on_message, on_close)
            except (OSError, EOFError, AuthenticationError) as e:  # not there yet, restarted, or gone
                if conn is not None:
                    conn.close()
                if time.monotonic() >= deadline:
                    raise EngineProcessError(f"no engine process at {address} ({e or type(e).__name__})") from None
                time.sleep(0.2)

    def add(self, rid: str, prompt_ids: list, params: SamplingParams) -> None:
        self._send(("add", rid, prompt_ids, params))

    def abort(self, rid: str) -> None:
        self._send(("abort", rid))

    def count_error(self) -> None:
        self._send(("error",))

    def _send(self, msg: tuple) -> None:
        if self.closed:
            raise EngineProcessError("the engine process is gone")
        try:
            with self._send_lock:
                self.conn.send(msg)
        except (OSError, ValueError) as e:
            raise EngineProcessError(f"the engine process is gone ({e})") from None

    def _read(self) -> None:
        try:
            while True:
                msg = self.conn.recv()
                try:
                    self._on_message(msg)
                except Exception:
                    log.exception("handling %r from the engine process failed", msg[0])
        except (EOFError, OSError):
            pass
        finally:
            self.closed = True
            self.conn.close()
            self._on_close()

    def close(self) -> None:
        """Shut the connection down; the reader thread sees the end, closes it and calls on_close."""
        self.closed = True
        _shutdown(self.conn)
        if threading.current_thread() is not self._reader:
            self._reader.join(timeout=5)


def _python() -> str:
    """The interpreter for the child. Inside a Triton stub sys.executable is the stub, not Python; the
    stub's packages come from the `python3` first on PATH (the Python backend stub imports through it), so that is the one to run."""
    if os.path.basename(sys.executable or "").startswith("python"):
        return sys.executable
    found = shutil.which("python3") or shutil.which("python")
    if not found:
        raise EngineProcessError("no python3 on PATH to run the engine process")
    return found


def start_engine_process(config: EngineConfig, address: str, on_message, on_close,
                         metrics_interval_s: float = 0.25,
                         env: Optional[dict] = None) -> tuple[EngineClient, subprocess.Popen]:
    """Spawn the engine process (with `env` added to this one's environment) and wait until its engine
    is built (weights, KV, CUDA graphs). Returns the owner's client and the process. Raises ConfigError for
    a bad config or checkpoint (the child's message), EngineProcessError if it died."""
    authkey = write_key(address)
    parent, child = socket.socketpair()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, **(env or {}),
               PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.Popen([_python(), "-m", "ouro_backend.serving.engine_process", "--owner-fd", str(child.fileno()),
                             "--address", address], pass_fds=[child.fileno()], env=env)
    child.close()
    conn = Connection(parent.detach())
    try:
        conn.send(("start", config, metrics_interval_s, authkey))
        kind, payload = conn.recv()
    except (EOFError, OSError):
        code = proc.wait(timeout=30)
        conn.close()
        _remove(key_path(address))
        raise EngineProcessError(f"the engine process exited with code {code} while starting "
                                 "(its traceback is in the server log)") from None
    if kind == "init_error":
        proc.wait(timeout=30)
        conn.close()
        _remove(key_path(address))
        raise ConfigError(payload)
    return EngineClient(conn, payload, on_message, on_close, name="ouro-engine-owner"), proc


# ------------------------------------------------------------------------------------------ child side
class FirstTokens:
    """Which of a step's outputs carry their request's first token: those go out at once, the rest during
    the next step (`EngineServer.serve`). The step loop's alone."""

    def __init__(self):
        self.started: set[str] = set()  # requests whose first token went out and that have not finished

    def split(self, outputs: list) -> tuple[list, list]:
        """(first-token outputs, the others)."""
        now: list = []
        later: list = []
        for out in outputs:
            (now if out.new_token_ids and out.request_id not in self.started else later).append(out)
        return now, later

    def sent(self, outputs: list) -> None:
        for out in outputs:
            if out.finished:
                self.started.discard(out.request_id)
            elif out.new_token_ids:
                self.started.add(out.request_id)


class _Peer:
    __slots__ = ("conn", "lock", "rids", "owner")

    def __init__(self, conn: Connection, owner: bool):
        self.conn = conn
        self.lock = threading.Lock()
        self.rids: set[str] = set()
        self.owner = owner

    def send(self, msg: tuple) -> bool:
        try:
            with self.lock:
                self.conn.send(msg)
            return True
        except (OSError, ValueError):
            return False


class EngineServer:
    """The child's side: the step loop on the main thread, one reader thread per connection."""

    def __init__(self, engine, owner: Connection, address: str, metrics_interval_s: float, authkey: bytes):
        self.engine = engine
        self.authkey = authkey
        self.metrics = MetricsBuffer()
        self.metrics_interval_s = metrics_interval_s
        self.trace = RequestTrace.from_env("engine")  # None unless $OURO_REQUEST_TRACE asks for the hops
        self.info = EngineInfo(engine.model_path, str(engine.device), str(engine.dtype).replace("torch.", ""),
                               engine.model_config.total_ut_steps, engine.max_model_len, engine.kv.num_blocks,
                               os.getpid(), engine.config.max_num_seqs, engine.config.max_waiting_requests,
                               engine.config.request_timeout_s)
        self._lock = threading.Lock()
        self._routes: dict[str, _Peer] = {}  # request id -> the connection that sent it
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._pending: list = []  # the last step's outputs, sent during the next step
        self._first = FirstTokens()
        self.owner = _Peer(owner, owner=True)
        self._peers: set[_Peer] = {self.owner}  # every authenticated connection: they get the load reports
        if os.path.exists(address):
            os.unlink(address)  # a previous engine of the same server pid and model name
        self.address = address
        self.listener = Listener(address, family="AF_UNIX", backlog=64)

    def serve(self) -> None:
        """The step loop, on the main thread. Each step's outputs are routed, counted and sent during the
        next step, while the GPU runs its loop (`ModelRunner.overlap`): host work the step loop does
        anyway, hidden behind the GPU. Not on a thread of its own: it would contend for the GIL with the
        host-bound step loop, which then stalls on every hand-back. Sending a step's tokens one round later
        costs them that round of latency, which time to first token would pay too: a request's first token therefore goes out as
        soon as its step returns (a few a step; the next launch is already running, asynchronous scheduling)."""
        threading.Thread(target=self._accept, name="accept", daemon=True).start()
        threading.Thread(target=self._read, args=(self.owner,), name="owner", daemon=True).start()
        engine = self.engine
        engine.runner.overlap = self._send_pending
        trace = RoundTrace.from_env(engine)
        step = trace.step if trace else engine.step
        self.owner.send(("ready", self.info))
        last_stats = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if now - last_stats >= self.metrics_interval_s:
                last_stats = now
                self._send_pending()
                self.owner.send(("stats", self.metrics.take(engine.stats())))
                load = ("load", self._load())
                with self._lock:
                    peers = list(self._peers)
                for peer in peers:
                    peer.send(load)
            if not engine.has_unfinished_requests():
                self._send_pending()
                self._wake.wait(self.metrics_interval_s)
                self._wake.clear()
                continue
            try:
                outputs = step()
            except Exception as e:
                # step() itself ends the requests a failure belongs to (outputs with an `error`, below);
                # an exception that escapes it belongs to no known request, so every open request ends.
                log.exception("engine.step failed")
                self._send_pending()
                self._fail_all(f"engine error: {type(e).__name__}: {e}")
                time.sleep(0.1)  # no busy loop if every step fails
                continue
            self._send_pending()  # what this step did not send (it had no GPU work to hide it behind)
            failed = [out for out in outputs if out.error is not None]
            if failed:  # after the earlier outputs of the same requests
                outputs = [out for out in outputs if out.error is None]
                self._first.sent(failed)
                self._fail([(out.request_id, out.error) for out in failed])
            first, self._pending = self._first.split(outputs)
            self._send(first)
        self._send_pending()
        self.listener.close()
        if trace:
            trace.write()
        if self.trace is not None:
            self.trace.write()

    def _send_pending(self) -> None:
        outputs, self._pending = self._pending, []
        self._send(outputs)

    def _send(self, outputs: list) -> None:
        if outputs:
            try:
                self._route(outputs)
            except Exception:  # a bug here must not fail the step it runs in
                log.exception("engine process: sending outputs failed")

    def _route(self, outputs: list) -> None:
        batches: dict[int, tuple[_Peer, list]] = {}
        with self._lock:
            peers = [self._routes.get(out.request_id) for out in outputs]
            for out in outputs:
                if out.finished:
                    peer = self._routes.pop(out.request_id, None)
                    if peer is not None:
                        peer.rids.discard(out.request_id)
        self.metrics.record(outputs)
        self._first.sent(outputs)
        if self.trace is not None:
            for out in outputs:
                if out.new_token_ids and out.first_token_time is not None:
                    self.trace.mark(out.request_id, "first_token", out.first_token_time)
                    self.trace.mark(out.request_id, "routed")
        load = self._load()
        for out, peer in zip(outputs, peers):
            if peer is None:
                continue
            batch = batches.setdefault(id(peer), (peer, []))[1]
            batch.append(Delta(out.request_id, out.new_token_ids, out.new_exit_depths, out.prefix_token_ids,
                               out.trim_chars, out.finish_reason if out.finished else None,
                               (out.num_spec_drafted, out.num_spec_accepted), out.num_cached_tokens))
        for peer, deltas in batches.values():
            if not peer.send(("outputs", deltas, load)):
                self._drop(peer)

    def _load(self) -> Load:
        return Load(self.engine.scheduler.num_unfinished, self.engine.kv.usage)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._admit, args=(conn,), name="client", daemon=True).start()

    def _admit(self, conn: Connection) -> None:
        """Authenticate a new connection (on its own thread, so a silent peer holds up no one; it is cut
        off after HANDSHAKE_TIMEOUT_S), then serve it. Nothing it sent is unpickled before that."""
        timer = threading.Timer(HANDSHAKE_TIMEOUT_S, _shutdown, args=(conn,))
        timer.start()
        try:
            deliver_challenge(conn, self.authkey)
            answer_challenge(conn, self.authkey)
        except (AuthenticationError, EOFError, OSError) as e:
            log.warning("engine process: refused a connection that did not authenticate (%s)",
                        e or type(e).__name__)
            conn.close()
            return
        finally:
            timer.cancel()
        peer = _Peer(conn, owner=False)
        if peer.send(("hello", self.info)):
            with self._lock:
                self._peers.add(peer)
            self._read(peer)

    def _read(self, peer: _Peer) -> None:
        try:
            while True:
                msg = peer.conn.recv()
                if msg[0] == "add":
                    self._add(peer, *msg[1:])
                elif msg[0] == "abort":
                    self.engine.abort_request(msg[1])
                    self._wake.set()
                elif msg[0] == "error":
                    self.metrics.add("errors", 1)
        except (EOFError, OSError):
            pass
        except Exception:
            log.exception("engine process: bad message; dropping the connection")
        self._drop(peer)
        if peer.owner:
            self._stop.set()
            self._wake.set()

    def _add(self, peer: _Peer, rid: str, prompt_ids: list, params: SamplingParams) -> None:
        if self.trace is not None:
            self.trace.mark(rid, "received")
        with self._lock:
            taken = rid in self._routes
            if not taken:
                self._routes[rid] = peer
                peer.rids.add(rid)
        try:
            if taken:  # checked here: the engine would refuse it too, but only after the route was replaced
                raise RequestError(f"request id {rid!r} is already in use")
            if len(self._routes) > self.info.capacity:  # every open request, this one included
                raise ServerBusy(f"server busy: {self.info.max_num_seqs} requests running and "
                                 f"{self.info.max_waiting_requests} waiting (max_waiting_requests); retry later")
            self.engine.add_request(rid, prompt_ids, params)
        except Exception as e:
            if not isinstance(e, RequestError):
                log.exception("add_request(%r) failed", rid)
            with self._lock:
                if not taken:
                    del self._routes[rid]
                    peer.rids.discard(rid)
            self.metrics.add("errors", 1)
            message = str(e) if isinstance(e, RequestError) else f"internal error: {type(e).__name__}: {e}"
            peer.send(("rejected", rid, message, "busy" if isinstance(e, ServerBusy) else "invalid"))
            return
        if self.trace is not None:
            self.trace.mark(rid, "added")
        self._wake.set()

    def _drop(self, peer: _Peer) -> None:
        """A client went away: abort its requests, which frees their KV."""
        with self._lock:
            self._peers.discard(peer)
            rids, peer.rids = list(peer.rids), set()
            for rid in rids:
                self._routes.pop(rid, None)
        for rid in rids:
            self.engine.abort_request(rid)
        self._wake.set()
        try:
            peer.conn.close()
        except OSError:
            pass

    def _fail(self, failures: list[tuple[str, str]]) -> None:
        """Tell each request's client that it ended with an error: ("failed", [rid, ...], message), one
        message per client and error. The engine has already ended these requests."""
        batches: dict[tuple[int, str], tuple[_Peer, list]] = {}
        with self._lock:
            for rid, message in failures:
                peer = self._routes.pop(rid, None)
                if peer is not None:
                    peer.rids.discard(rid)
                    batches.setdefault((id(peer), message), (peer, []))[1].append(rid)
        self.metrics.add("errors", len(failures))
        for (_, message), (peer, rids) in batches.items():
            peer.send(("failed", rids, message))

    def _fail_all(self, message: str) -> None:
        """End every open request (a failure step() could not attribute): aborted in the engine, failed at
        its client."""
        with self._lock:
            rids = list(self._routes)
        for rid in rids:
            self.engine.abort_request(rid)
        self._fail([(rid, message) for rid in rids])


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(description="The Ouro engine process (started by the ouro_engine model)")
    ap.add_argument("--owner-fd", type=int, required=True)
    ap.add_argument("--address", required=True)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[ouro engine %(process)d] %(levelname)s %(message)s")
    owner = Connection(args.owner_fd)
    kind, config, metrics_interval_s, authkey = owner.recv()
    try:
        from ..engine.llm_engine import LLMEngine

        engine = LLMEngine(config)
    except ConfigError as e:
        owner.send(("init_error", str(e)))
        return 2
    except Exception as e:
        traceback.print_exc()
        owner.send(("init_error", f"the engine failed to start: {type(e).__name__}: {e}"))
        return 1
    server = EngineServer(engine, owner, args.address, metrics_interval_s, authkey)
    log.info("serving on %s (pid %d)", args.address, os.getpid())
    try:
        server.serve()
    finally:
        _remove(args.address)
        _remove(key_path(args.address))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown of CUDA state and daemon threads


if __name__ == "__main__":
    # Run the module under its real name: what crosses the sockets must unpickle as
    # ouro_backend.serving.engine_process.X on the other side, not as __main__.X.
    from ouro_backend.serving.engine_process import main as _main

    sys.exit(_main())
