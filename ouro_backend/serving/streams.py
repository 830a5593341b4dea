"""What the two decoupled models (`ouro_engine`, `ouro`) share: requests streamed to and from the engine
process, and the threads that answer them.

Thread design (as in the vLLM Triton backend, with the engine in its own process):
* `execute()` only validates and enqueues: it parses the request, registers a `Stream` and sends the
  request to the least loaded engine process (engine_pool.EngineRouter); a bad request gets a TritonError
  response with FINAL at once.
* Each engine connection's reader thread files each step's `Delta`s into their streams' pending buffers.
* `response_threads` sender threads send them. Each request is pinned to one sender (by its id), so its
  responses stay in order; what piles up while a `send()` waits on the server goes out as one response,
  so a busy server coalesces tokens instead of queueing them. A request's first response goes ahead of
  the later responses waiting for its sender (`SendQueue`): time to first token does not wait for other
  requests' tokens. Non-streaming requests get one response.
* A `CancelWatcher` asks every open request's sender `is_cancelled()` every `cancel_check_interval_s`
  (a round trip to the server each, so never on a hot thread) and aborts cancelled ones in the engine,
  which frees their KV; their last response says finish_reason "cancelled".
"""

from __future__ import annotations

import abc
import collections
import logging
import threading
import time
import zlib
from typing import Any

from ..outputs import PREFIX_WINDOW
from ..sampling_params import RequestError
from . import protocol
from .cancellation import CancelWatcher
from .engine_errors import EngineProcessError, ServerBusy
from .engine_messages import Delta, Failed, FromEngine, LoadReport, Outputs, Rejected
from .engine_pool import EngineRouter
from .options import StreamOptions
from .request_trace import RequestTrace

log = logging.getLogger(__name__)


class Stream:
    """One request between execute() and its FINAL response. `data_lock` guards the pending buffers;
    `send_lock` orders the FINAL send against is_cancelled(): asking a sender whose final response went
    out crashes tritonserver 2.51 (the response factory is gone)."""

    __slots__ = (
        "rid",
        "sender",
        "parsed",
        "num_input",
        "data_lock",
        "send_lock",
        "done",
        "cancelled",
        "ids",
        "depths",
        "logprobs",
        "prefix",
        "trim",
        "reason",
        "error",
        "error_code",
        "queued",
        "worker",
        "spec_counts",
        "num_cached",
        "engine",
        "responded",
        "timeout_s",
        "deadline",
        "interval",
    )

    def __init__(
        self,
        rid: str,
        sender: Any,
        parsed: protocol.ParsedRequest,
        num_input: int,
        worker: int,
        engine: int,
        received: float = 0.0,
        timeout_s: float | None = None,
    ):
        self.rid = rid
        self.sender = sender
        self.parsed = parsed
        self.num_input = num_input
        self.data_lock = threading.Lock()
        self.send_lock = threading.Lock()
        self.done = False  # FINAL sent
        self.cancelled = False
        self.ids: list[int] = []
        self.depths: list[int] = []
        self.logprobs: list[float] = []  # one per token in `ids` when the request asked for them, else empty
        self.prefix: list[int] | None = None
        self.trim = 0
        self.reason: str | None = None  # set with the engine's last delta
        self.error: str | None = None
        self.error_code: str | None = None  # a pb_utils.TritonError code name (None: the default)
        self.queued = False
        self.worker = worker
        self.spec_counts = (0, 0)
        self.num_cached = 0
        self.engine = engine  # the index of the engine process that runs it
        self.responded = False  # a response with tokens went out
        self.timeout_s = timeout_s
        # time.monotonic() after which it ends with a timeout error; None: never
        self.deadline = None if timeout_s is None else received + timeout_s
        # streaming: tokens per response (0: every token waiting when the sender gets to it)
        self.interval = 0


def _context(prefix: list[int], ids: list[int], start: int) -> list[int]:
    """The detokenization context of ``ids[start:]``: the last PREFIX_WINDOW ids before it."""
    return (prefix + ids[:start])[-PREFIX_WINDOW:] if start else prefix


class SendQueue:
    """One sender thread's streams with a response due, oldest first; streams whose first response is due
    go before the others. On a busy server a sender is always behind (that is how responses coalesce), and
    in a plain FIFO a first token would wait for every stream queued before it (serving/README.md, "Where
    served TTFT goes")."""

    def __init__(self):
        self._ready = threading.Condition()
        self._first: collections.deque = collections.deque()
        self._later: collections.deque = collections.deque()

    def put(self, item: Stream | None, first: bool = False) -> None:
        with self._ready:
            (self._first if first else self._later).append(item)
            self._ready.notify()

    def get(self) -> Stream | None:
        with self._ready:
            while not self._first and not self._later:
                self._ready.wait()
            return (self._first or self._later).popleft()


class StreamingModel(abc.ABC):
    """Base of EngineModel and FrontModel: they set `router` (their connections to the engine processes),
    say how to read a request, and may build other responses (`response_arrays`) and count their own errors
    (`count_error`)."""

    model_name = "ouro"
    router: EngineRouter | None = None

    def setup_streams(self, pb: Any, serving: StreamOptions) -> None:
        self.pb = pb
        self._lock = threading.Lock()
        self._streams: dict[str, Stream] = {}
        # A queue per sender; a stream is in it at most once (Stream.queued).
        self._queues = [SendQueue() for _ in range(serving.response_threads)]
        self._senders = [
            threading.Thread(target=self._send_loop, args=(q,), name=f"ouro-send-{i}", daemon=True)
            for i, q in enumerate(self._queues)
        ]
        for t in self._senders:
            t.start()
        self._stream_interval = serving.stream_interval
        self._watcher = CancelWatcher(serving.cancel_check_interval_s, self._open_streams, self._cancel, self._expire)
        self._trace = RequestTrace.from_env("front")  # None unless $OURO_REQUEST_TRACE asks for the hops

    # ---------------------------------------------------------------- what a subclass provides
    @abc.abstractmethod
    def parse(self, request: Any) -> tuple[protocol.ParsedRequest, list[int], str] | None:
        """(parsed request, prompt ids, request id), or None when the request was a control request that
        is already answered. Raises RequestError for bad input."""

    def response_arrays(self, fields: dict, rid: str) -> dict:
        """One response's tensors from its fields (`protocol.engine_response_arrays`'s arguments) for
        request `rid`: the engine's tensors here; the front returns the client's directly (it detokenizes)."""
        return protocol.engine_response_arrays(**fields)

    def count_error(self) -> None:
        """A request ended with an error made here, not in the engine (`ouro_request_errors_total`)."""

    # ---------------------------------------------------------------- execute (Triton's thread)
    def execute(self, requests: list) -> None:
        for request in requests:
            sender = request.get_response_sender()
            received = time.monotonic()
            try:
                parsed = self.parse(request)
                if parsed is None:
                    sender.send(flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                    continue
                trace = self._trace
                if trace is not None:
                    trace.mark(parsed[2], "received", received)
                    trace.mark(parsed[2], "parsed")
                    if request.request_id():
                        trace.alias(request.request_id(), parsed[2])
                self._submit(
                    sender,
                    *parsed,
                    received=received,
                    timeout_us=request.timeout() or protocol.timeout_parameter_us(request.parameters()),
                )
            except ServerBusy as e:
                self.count_error()
                self.send_error(sender, f"{self.model_name}: {e}", code="UNAVAILABLE")
            except RequestError as e:
                self.count_error()
                self.send_error(sender, f"{self.model_name}: invalid request: {e}")
            except EngineProcessError as e:
                self.send_error(sender, f"{self.model_name}: {e}")
            except Exception as e:  # a bug, not the client's fault: still answer the request
                log.exception("execute failed")
                self.send_error(sender, f"{self.model_name}: internal error: {type(e).__name__}: {e}")
        return None

    def _submit(
        self,
        sender: Any,
        parsed: protocol.ParsedRequest,
        prompt_ids: list[int],
        rid: str,
        received: float,
        timeout_us: int = 0,
    ) -> None:
        assert self.router is not None  # set before the model takes requests
        assert parsed.params is not None  # only control requests have none, and parse() answers those
        index, client = self.router.pick()
        # The server's request_timeout_s, or the request's own Triton `timeout` (microseconds) if shorter.
        limits = [t for t in (client.info.request_timeout_s, timeout_us / 1e6) if t > 0]
        stream = Stream(
            rid,
            sender,
            parsed,
            len(prompt_ids),
            zlib.crc32(rid.encode()) % len(self._queues),
            index,
            received,
            min(limits) if limits else None,
        )
        stream.interval = self._stream_interval if parsed.stream_interval is None else parsed.stream_interval
        with self._lock:
            if rid in self._streams:
                self.router.release(index)
                raise RequestError(f"request_id {rid!r} is already running")
            self._streams[rid] = stream
        if self._trace is not None:  # before the write: the engine process may read it before add() returns
            self._trace.mark(rid, "submitted")
        try:
            client.add(rid, prompt_ids, parsed.params)
        except BaseException:
            with self._lock:
                self._streams.pop(rid, None)
            self.router.release(index)
            raise

    # ---------------------------------------------------------------- from the engines (reader threads)
    def on_engine_message(self, index: int, msg: FromEngine) -> None:
        """A message from engine `index` (Stats are the owner's: EngineModel takes them first)."""
        match msg:
            case Outputs(deltas, load):
                for delta in deltas:
                    self._deliver(delta)
                assert self.router is not None  # outputs are for requests sent through it
                self.router.report(index, load)
            case LoadReport(load):
                router = self.router  # None while the front still connects (no request of its own yet)
                if router is not None:
                    router.report(index, load)
            case Rejected(rid, message, "busy"):
                self._end_with_error(rid, f"{self.model_name}: {message}", code="UNAVAILABLE")
            case Rejected(rid, message, _):  # "invalid"
                self._end_with_error(rid, f"{self.model_name}: invalid request: {message}")
            case Failed(rids, message):
                for rid in rids:
                    self._end_with_error(rid, f"{self.model_name}: {message}")

    def on_engine_closed(self, index: int) -> None:
        """Engine `index`'s connection ended: its requests end with an error; the other engines serve on."""
        with self._lock:
            rids = [rid for rid, s in self._streams.items() if s.engine == index]
        for rid in rids:
            self._end_with_error(rid, f"{self.model_name}: the engine process exited; see the server log")

    def _deliver(self, d: Delta) -> None:
        with self._lock:
            s = self._streams.get(d.rid)
            if s is not None and d.finish_reason is not None:
                del self._streams[d.rid]
        if s is None:
            return
        if d.finish_reason is not None:
            assert self.router is not None  # the stream was sent through it
            self.router.release(s.engine)
        if self._trace is not None and d.ids:
            self._trace.mark(d.rid, "delivered")
        with s.data_lock:
            if s.prefix is None:
                s.prefix = list(d.prefix)
            s.ids.extend(d.ids)
            s.depths.extend(d.depths)
            s.logprobs.extend(d.logprobs)
            s.spec_counts, s.num_cached = d.spec_counts, d.num_cached
            if d.finish_reason is not None:
                s.reason, s.trim = d.finish_reason, d.trim
            ready = d.finish_reason is not None or (s.parsed.stream and len(s.ids) >= max(1, s.interval))
            if not ready or s.queued:
                return
            s.queued = True
        self._queues[s.worker].put(s, first=not s.responded)

    def _end_with_error(self, rid: str, message: str, code: str | None = None) -> None:
        with self._lock:
            s = self._streams.pop(rid, None)
        if s is None:
            return
        assert self.router is not None  # the stream was sent through it
        self.router.release(s.engine)
        with s.data_lock:
            s.error, s.error_code = message, code
            if s.queued:
                return
            s.queued = True
        self._queues[s.worker].put(s)

    # ---------------------------------------------------------------- sender threads
    def _send_loop(self, q: SendQueue) -> None:
        while True:
            s = q.get()
            if s is None:
                return
            try:
                self._send_pending(s)
            except Exception:
                log.exception("sending a response for %s failed", s.rid)

    def _send_pending(self, s: Stream) -> None:
        """What the stream got since its previous response: one response, or with a stream interval N,
        responses of N tokens each (a remainder short of N waits for more tokens unless the request ended)."""
        with s.data_lock:
            s.queued = False
            error, error_code, reason, trim = s.error, s.error_code, s.reason, s.trim
            prefix, spec_counts = s.prefix or [], s.spec_counts
            n = s.interval if s.parsed.stream else 0
            # NOTE the stream keeps the detokenization context of the tokens after the ones taken here: the
            # engine sends a request's prefix only with its first tokens (engine_messages.Delta).
            if not n or reason is not None:  # everything waiting
                ids, depths, logprobs, s.ids, s.depths, s.logprobs = s.ids, s.depths, s.logprobs, [], [], []
                s.prefix = _context(prefix, ids, len(ids))
            else:  # whole intervals
                take = len(s.ids) // n * n
                ids, depths, logprobs = s.ids[:take], s.depths[:take], s.logprobs[:take]
                s.ids, s.depths, s.logprobs = s.ids[take:], s.depths[take:], s.logprobs[take:]
                s.prefix = _context(prefix, ids, take)
        if error is not None:
            with s.send_lock:
                if not s.done:
                    s.done = True
                    self.send_error(s.sender, error, error_code)
            return
        final = reason is not None
        if not ids and not final:
            return
        # A stop string's trim applies to the final response's text, so that response keeps what it needs.
        pieces = [ids[i : i + n] for i in range(0, len(ids), n)] if n and len(ids) > n and not trim else [ids]
        start = 0
        for k, piece in enumerate(pieces):
            last = k == len(pieces) - 1
            ok = self._send_response(
                s,
                piece,
                depths[start : start + len(piece)],
                logprobs[start : start + len(piece)],
                _context(prefix, ids, start),
                reason if last else None,
                trim if last else 0,
                spec_counts,
            )
            start += len(piece)
            if not ok:
                return

    def _send_response(
        self,
        s: Stream,
        ids: list[int],
        depths: list[int],
        logprobs: list[float],
        prefix: list[int],
        reason: str | None,
        trim: int,
        spec_counts: tuple[int, int],
    ) -> bool:
        """One response (FINAL with `reason`); False when the request ended instead (an error response)."""
        pb = self.pb
        final = reason is not None
        p = s.parsed
        fields = dict(
            output_ids=ids,
            prefix_ids=prefix,
            exit_depths=depths,
            trim_chars=trim,
            num_input_tokens=s.num_input,
            finish_reason=reason,
            echo_text=(p.prompt_text or "") if final and p.echo_prompt else "",
            return_flags=p.return_flags,
            spec_counts=spec_counts,
            num_cached_tokens=s.num_cached,
            log_probs=logprobs,
        )
        try:
            arrays = self.response_arrays(fields, s.rid)
            response = pb.InferenceResponse(output_tensors=[pb.Tensor(k, v) for k, v in arrays.items()])
        except Exception as e:  # e.g. the front's detokenizer: end the request, stop the engine
            if not isinstance(e, RequestError):
                log.exception("building the response of %s failed", s.rid)
            message = str(e) if isinstance(e, RequestError) else f"internal error: {type(e).__name__}: {e}"
            self.count_error()
            self._cancel(s)
            with s.send_lock:
                if not s.done:
                    s.done = True
                    self.send_error(s.sender, f"{self.model_name}: {message}")
            return False
        with s.send_lock:
            if s.done:
                return False
            try:
                s.sender.send(response, flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0)
            except Exception as e:  # the client is gone; the watcher aborts the request
                log.debug("send failed for %s: %s", s.rid, e)
            s.done = final
        s.responded = True
        if self._trace is not None and ids:
            self._trace.mark(s.rid, "responded")
        return True

    def send_error(self, sender: Any, message: str, code: str | None = None) -> None:
        """A FINAL error response; `code` names a pb_utils.TritonError code (UNAVAILABLE: HTTP 503)."""
        pb = self.pb
        try:
            error = pb.TritonError(message) if code is None else pb.TritonError(message, getattr(pb.TritonError, code))
            sender.send(
                pb.InferenceResponse(output_tensors=[], error=error), flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
            )
        except Exception as e:
            log.debug("error response failed: %s", e)

    # ---------------------------------------------------------------- cancellation
    def _open_streams(self) -> list[Stream]:
        with self._lock:
            return [s for s in self._streams.values() if not s.cancelled]

    def _expire(self, s: Stream) -> None:
        """Past its deadline: abort it in the engine and end it with a timeout error."""
        self._cancel(s)
        self.count_error()
        self._end_with_error(
            s.rid,
            f"{self.model_name}: request timed out: not finished {s.timeout_s:g}s after it arrived",
            code="UNAVAILABLE",
        )

    def _cancel(self, s: Stream) -> None:
        if s.cancelled:
            return
        s.cancelled = True
        assert self.router is not None  # the stream was sent through it
        client = self.router.clients[s.engine]
        if client is None:
            return
        try:
            client.abort(s.rid)
        except EngineProcessError:
            pass  # gone: its requests end with the connection

    # ---------------------------------------------------------------- unload
    def close_streams(self, message: str) -> None:
        if not hasattr(self, "_watcher"):
            return
        self._watcher.stop()
        if self._trace is not None:
            self._trace.write()
        with self._lock:
            rids = list(self._streams)
        for rid in rids:
            self._end_with_error(rid, message)
        for q in self._queues:
            q.put(None)
        for t in self._senders:
            t.join(timeout=10)
