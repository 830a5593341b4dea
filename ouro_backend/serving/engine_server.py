"""The engine process (the shape of vLLM V1's EngineCore): `python -m ouro_backend.serving.engine_server
--owner-fd FD --address PATH`, spawned by engine_client.start_engine_process.

It reads its Start from the owner channel (fd FD), builds the engine, answers Ready (or InitError and
exits), then runs the step loop on the main thread until the owner channel closes. Clients connect to
the Unix socket at PATH (engine_auth: nothing is unpickled before the handshake); each gets the outputs
of its own requests. The messages: engine_messages.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import threading
import time
import traceback
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from ..config import ConfigError
from ..engine.round_trace import RoundTrace
from ..outputs import RequestOutput
from ..sampling_params import RequestError, SamplingParams
from .engine_auth import authenticate, key_path, listen, remove_file
from .engine_errors import EngineProcessError, ServerBusy
from .engine_messages import (
    AbortRequest,
    AddRequest,
    CountError,
    Delta,
    EngineInfo,
    Failed,
    FromEngine,
    Hello,
    InitError,
    Load,
    LoadReport,
    Outputs,
    Ready,
    Rejected,
    Start,
    Stats,
    recv_message,
    send_message,
)
from .metrics import MetricsBuffer
from .request_trace import RequestTrace

if TYPE_CHECKING:
    from ..engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)


class FirstTokens:
    """Which of a step's outputs carry their request's first token: those go out at once, the rest during
    the next step (`EngineServer.serve`). The step loop's alone."""

    def __init__(self) -> None:
        self.started: set[str] = set()  # requests whose first token went out and that have not finished

    def split(self, outputs: list[RequestOutput]) -> tuple[list[RequestOutput], list[RequestOutput]]:
        """(first-token outputs, the others)."""
        now: list[RequestOutput] = []
        later: list[RequestOutput] = []
        for out in outputs:
            (now if out.new_token_ids and out.request_id not in self.started else later).append(out)
        return now, later

    def sent(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.finished:
                self.started.discard(out.request_id)
            elif out.new_token_ids:
                self.started.add(out.request_id)


class _Peer:
    """One authenticated connection (or the owner channel) and the requests it sent that are still open."""

    __slots__ = ("conn", "lock", "rids", "owner")

    def __init__(self, conn: Connection, owner: bool):
        self.conn = conn
        self.lock = threading.Lock()
        self.rids: set[str] = set()
        self.owner = owner

    def send(self, msg: Ready | Hello | FromEngine) -> bool:
        """False if the peer is gone."""
        try:
            with self.lock:
                send_message(self.conn, msg)
            return True
        except (OSError, ValueError):
            return False


class EngineServer:
    """The step loop on the main thread, one reader thread per connection."""

    def __init__(self, engine: LLMEngine, owner: Connection, address: str, metrics_interval_s: float, authkey: bytes):
        self.engine = engine
        self.authkey = authkey
        self.metrics = MetricsBuffer()
        self.metrics_interval_s = metrics_interval_s
        self.trace = RequestTrace.from_env("engine")  # None unless $OURO_REQUEST_TRACE asks for the hops
        self.info = EngineInfo(
            engine.model_path,
            str(engine.device),
            str(engine.dtype).replace("torch.", ""),
            engine.model_config.num_loops,
            engine.max_model_len,
            engine.kv.num_blocks,
            os.getpid(),
            engine.config.max_num_seqs,
            engine.config.max_waiting_requests,
            engine.config.request_timeout_s,
        )
        self._lock = threading.Lock()
        self._routes: dict[str, _Peer] = {}  # request id -> the connection that sent it
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._pending: list[RequestOutput] = []  # the last step's outputs, sent during the next step
        self._first = FirstTokens()
        self.owner = _Peer(owner, owner=True)
        self._peers: set[_Peer] = {self.owner}  # every authenticated connection: they get the load reports
        self.address = address
        self.listener = listen(address)

    def serve(self) -> None:
        """The step loop, on the main thread, until the owner channel closes. Each step's outputs are
        routed, counted and sent during the next step, while the GPU runs its loop (`ModelRunner.overlap`):
        host work the step loop does anyway, hidden behind the GPU. Not on a thread of its own: it would
        contend for the GIL with the host-bound step loop, which then stalls on every hand-back. Sending a
        step's tokens one round later costs them that round of latency, which time to first token would pay
        too: a request's first token therefore goes out as soon as its step returns (a few a step; the next
        launch is already running, asynchronous scheduling)."""
        threading.Thread(target=self._accept, name="accept", daemon=True).start()
        threading.Thread(target=self._read, args=(self.owner,), name="owner", daemon=True).start()
        engine = self.engine
        engine.runner.overlap = self._send_pending
        trace = RoundTrace.from_env(engine)
        step = trace.step if trace else engine.step
        self.owner.send(Ready(self.info))
        last_stats = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if now - last_stats >= self.metrics_interval_s:
                last_stats = now
                self._send_pending()
                self.owner.send(Stats(self.metrics.take(engine.stats())))
                report = LoadReport(self._load())
                with self._lock:
                    peers = list(self._peers)
                for peer in peers:
                    peer.send(report)
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
            errors = [(out.request_id, out.error) for out in outputs if out.error is not None]
            if errors:  # after the earlier outputs of the same requests
                self._first.sent([out for out in outputs if out.error is not None])
                outputs = [out for out in outputs if out.error is None]
                self._fail(errors)
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

    def _send(self, outputs: list[RequestOutput]) -> None:
        if outputs:
            try:
                self._route(outputs)
            except Exception:  # a bug here must not fail the step it runs in
                log.exception("engine process: sending outputs failed")

    def _route(self, outputs: list[RequestOutput]) -> None:
        """One Outputs message per client, with the Deltas of its requests."""
        batches: dict[int, tuple[_Peer, list[Delta]]] = {}
        with self._lock:
            peers = [self._routes.get(out.request_id) for out in outputs]
            for out in outputs:
                if out.finished:
                    peer = self._routes.pop(out.request_id, None)
                    if peer is not None:
                        peer.rids.discard(out.request_id)
        self.metrics.record(outputs)
        # NOTE a client keeps each stream's detokenization context from the first Delta with tokens on, so
        # only Deltas before that one carry the prefix.
        fresh = [out.request_id not in self._first.started for out in outputs]
        self._first.sent(outputs)
        if self.trace is not None:
            for out in outputs:
                if out.new_token_ids and out.first_token_time is not None:
                    self.trace.mark(out.request_id, "first_token", out.first_token_time)
                    self.trace.mark(out.request_id, "routed")
        load = self._load()
        for out, peer, first in zip(outputs, peers, fresh):
            if peer is None:
                continue
            batch = batches.setdefault(id(peer), (peer, []))[1]
            batch.append(
                Delta(
                    out.request_id,
                    out.new_token_ids,
                    out.new_exit_depths,
                    out.prefix_token_ids if first else [],
                    out.trim_chars,
                    out.finish_reason if out.finished else None,
                    (out.num_spec_drafted, out.num_spec_accepted),
                    out.num_cached_tokens,
                    out.new_logprobs,
                )
            )
        for peer, deltas in batches.values():
            if not peer.send(Outputs(deltas, load)):
                self._drop(peer)

    def _load(self) -> Load:
        return Load(self.engine.scheduler.num_unfinished, self.engine.kv.pool.usage)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._admit, args=(conn,), name="client", daemon=True).start()

    def _admit(self, conn: Connection) -> None:
        """Authenticate a new connection on its own thread, so a silent peer holds up no one, then serve it."""
        try:
            authenticate(conn, self.authkey)
        except (AuthenticationError, EOFError, OSError) as e:
            log.warning("engine process: refused a connection that did not authenticate (%s)", e or type(e).__name__)
            conn.close()
            return
        peer = _Peer(conn, owner=False)
        if peer.send(Hello(self.info)):
            with self._lock:
                self._peers.add(peer)
            self._read(peer)

    def _read(self, peer: _Peer) -> None:
        try:
            while True:
                match recv_message(peer.conn):
                    case AddRequest(rid, prompt_ids, params):
                        self._add(peer, rid, prompt_ids, params)
                    case AbortRequest(rid):
                        with self._lock:
                            mine = rid in peer.rids  # a client aborts only its own requests
                        if mine:
                            self.engine.abort_request(rid)
                            self._wake.set()
                    case CountError():
                        self.metrics.add("errors", 1)
        except (EOFError, OSError):
            pass
        except Exception:
            log.exception("engine process: bad message; dropping the connection")
        self._drop(peer)
        if peer.owner:
            self._stop.set()
            self._wake.set()

    def _add(self, peer: _Peer, rid: str, prompt_ids: list[int], params: SamplingParams) -> None:
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
                raise ServerBusy(
                    f"server busy: {self.info.max_num_seqs} requests running and "
                    f"{self.info.max_waiting_requests} waiting (max_waiting_requests); retry later"
                )
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
            peer.send(Rejected(rid, message, "busy" if isinstance(e, ServerBusy) else "invalid"))
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
        """Tell each request's client that it ended with an error: one Failed per client and error. The
        engine has already ended these requests."""
        batches: dict[tuple[int, str], tuple[_Peer, list[str]]] = {}
        with self._lock:
            for rid, message in failures:
                peer = self._routes.pop(rid, None)
                if peer is not None:
                    peer.rids.discard(rid)
                    batches.setdefault((id(peer), message), (peer, []))[1].append(rid)
        self.metrics.add("errors", len(failures))
        for (_, message), (peer, rids) in batches.items():
            peer.send(Failed(rids, message))

    def _fail_all(self, message: str) -> None:
        """End every open request (a failure step() could not attribute): aborted in the engine, failed at
        its client."""
        with self._lock:
            rids = list(self._routes)
        for rid in rids:
            self.engine.abort_request(rid)
        self._fail([(rid, message) for rid in rids])


# Benchmarks only (benchmarks/stand_in_engine.py): "module:callable" that returns a stand-in for the engine's
# ModelRunner, given the engine, so the serving path can be measured without the model's cost.
RUNNER_ENV = "OURO_ENGINE_RUNNER"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="The Ouro engine process (started by the ouro_engine model)")
    ap.add_argument("--owner-fd", type=int, required=True)
    ap.add_argument("--address", required=True)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[ouro engine %(process)d] %(levelname)s %(message)s")
    owner = Connection(args.owner_fd)
    start = recv_message(owner)
    if not isinstance(start, Start):
        raise EngineProcessError(f"the owner's first message is {type(start).__name__}, not Start")
    try:
        from ..engine.llm_engine import LLMEngine

        engine = LLMEngine(start.config)
        runner = os.environ.get(RUNNER_ENV)
        if runner:  # benchmarks only: a stand-in for the model runner ("module:callable", called with the engine)
            module, _, name = runner.partition(":")
            engine.runner = getattr(importlib.import_module(module), name)(engine)
            log.warning("%s=%s: the model runner is replaced (benchmarking the serving path)", RUNNER_ENV, runner)
    except ConfigError as e:
        send_message(owner, InitError(str(e)))
        return 2
    except Exception as e:
        traceback.print_exc()
        send_message(owner, InitError(f"the engine failed to start: {type(e).__name__}: {e}"))
        return 1
    server = EngineServer(engine, owner, args.address, start.metrics_interval_s, start.authkey)
    log.info("serving on %s (pid %d)", args.address, os.getpid())
    try:
        server.serve()
    finally:
        remove_file(args.address)
        remove_file(key_path(args.address))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown of CUDA state and daemon threads


if __name__ == "__main__":
    sys.exit(main())
