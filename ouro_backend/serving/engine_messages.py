"""What an engine process and its peers say to each other: one frozen dataclass per message, and how each
goes over the wire (`send_message` / `recv_message`). Receivers dispatch on the class (`match` / isinstance).

The wire: one multiprocessing.connection message (`send_bytes`) per message, its first byte the kind:
`Outputs`, the one sent every step and the bulk of the traffic, is a compact binary frame (`_encode_outputs`:
columns of fixed-size numbers, no pickling); every other message is pickled.

Two kinds of connection, and the order on each:

  owner channel (the socketpair the `ouro_engine` model spawned the engine with; engine_client.start_engine_process)
    owner  -> engine   Start                       first: the engine config, the metrics interval, the socket's key
    engine -> owner    Ready | InitError           the engine is built, or could not be (then the engine exits)
    then, after Ready, everything a socket connection carries after Hello, and:
    engine -> owner    Stats                       every `metrics_interval_s`

  socket connection (engine_client.EngineClient.connect; authenticated first: engine_auth)
    engine -> client   Hello                       first
    then, in any order:
    client -> engine   AddRequest | AbortRequest | CountError
    engine -> client   Outputs                     after each step that moved the client's requests
                       LoadReport                  every `metrics_interval_s` (for routing: engine_pool.EngineRouter)
                       Rejected                    add_request refused a request: it never ran
                       Failed                      the engine ended requests with an error; they are gone

A client gets Outputs, Rejected and Failed only for its own requests, and nothing more for a request after
its last Delta (the one with a finish reason), its Rejected or its Failed. The engine stops when its owner
channel closes (the owner was unloaded, or died); when a client's connection closes, it aborts that
client's requests.
"""

from __future__ import annotations

import pickle
import struct
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

if TYPE_CHECKING:
    from ..config import EngineConfig
    from ..sampling_params import SamplingParams
    from .metrics import MetricsSnapshot


# ------------------------------------------------------------------------------------------ payloads
class Delta(NamedTuple):
    """What one step produced for one request: new tokens (and the few before them, for stateless
    detokenization) and, on the last one, the finish reason and the characters a stop string cuts."""

    rid: str
    ids: list
    depths: list
    prefix: list  # on a request's first Delta with tokens (and those before it); [] after: the client keeps it
    trim: int
    finish_reason: str | None
    spec_counts: tuple[int, int] = (0, 0)  # self-speculation: the request's (drafted, accepted) so far
    num_cached: int = 0  # prompt tokens whose KV came from the prefix cache
    # One logprob per new token when the request asked for them (SamplingParams.logprobs), else empty.
    logprobs: Sequence[float] = ()


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


# ------------------------------------------------------------------------------------------ owner channel
@dataclass(frozen=True, slots=True)
class Start:
    config: EngineConfig
    metrics_interval_s: float
    authkey: bytes = field(repr=False)  # the key every socket connection must prove it holds


@dataclass(frozen=True, slots=True)
class Ready:
    info: EngineInfo


@dataclass(frozen=True, slots=True)
class InitError:
    message: str  # for the owner to raise as a ConfigError


@dataclass(frozen=True, slots=True)
class Stats:
    snapshot: MetricsSnapshot  # what the engine counted since the previous Stats (every client's requests)


# ------------------------------------------------------------------------------------------ engine -> client
@dataclass(frozen=True, slots=True)
class Hello:
    info: EngineInfo


@dataclass(frozen=True, slots=True)
class Outputs:
    deltas: list[Delta]
    load: Load  # the engine's load after the step


@dataclass(frozen=True, slots=True)
class LoadReport:
    load: Load


RejectKind = Literal["invalid", "busy"]  # a RequestError (a bad request); over the engine's capacity (ServerBusy)


@dataclass(frozen=True, slots=True)
class Rejected:
    rid: str
    message: str
    kind: RejectKind


@dataclass(frozen=True, slots=True)
class Failed:
    rids: list[str]
    message: str  # each request's own error, or that of the launch they were in


# ------------------------------------------------------------------------------------------ client -> engine
@dataclass(frozen=True, slots=True)
class AddRequest:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True, slots=True)
class AbortRequest:
    rid: str  # only a request this client added is aborted; an unknown, finished or foreign one is ignored


@dataclass(frozen=True, slots=True)
class CountError:
    """The client answered one of its requests with an error of its own (for the engine's metrics)."""


ToEngine = AddRequest | AbortRequest | CountError
FromEngine = Outputs | LoadReport | Rejected | Failed | Stats  # EngineClient's on_message gets these (Stats: the owner)


# ------------------------------------------------------------------------------------------ the wire
_PICKLED, _OUTPUTS = b"P", b"O"
_FINISH = (None, "stop", "length", "abort", "error")  # Delta.finish_reason <-> its byte in a frame
_FINISH_CODE = {r: i for i, r in enumerate(_FINISH)}
# kv_usage, requests, deltas, token ids, prefix ids, bytes of the joined request ids
_HEADER = struct.Struct("<dIIIII")
_U32, _I32, _U8, _F32 = "I", "i", "B", "f"
assert array(_U32).itemsize == 4 and array(_I32).itemsize == 4  # NOTE the frame's widths on every platform
_WITH_LOGPROBS = 0x80  # set in a Delta's finish byte: its tokens' fp32 logprobs are in the frame's last column


def _encode_outputs(msg: Outputs) -> bytes | None:
    """Outputs as one binary frame: the header, the request ids joined by NUL, then per-Delta columns
    (token counts, prefix counts, finish codes, trims, speculation counts, cached prompt tokens) and the
    token ids, exit depths and prefix ids of all Deltas end to end, and last the logprobs of the Deltas that
    carry them (a flag bit of their finish byte: requests that did not ask pay nothing). None when a Delta
    does not fit the frame (a NUL in a request id, an unknown finish reason, a value out of its column's
    range, logprobs not one per token): it is pickled."""
    ds = msg.deltas
    rids = [d.rid for d in ds]
    joined = "\0".join(rids)
    if rids and joined.count("\0") != len(rids) - 1:
        return None
    try:
        ids = array(_I32, [t for d in ds for t in d.ids])
        depths = array(_U8, [x for d in ds for x in d.depths])
        prefix = array(_I32, [t for d in ds for t in d.prefix])
        finish = array(_U8, [_FINISH_CODE[d.finish_reason] | (_WITH_LOGPROBS if d.logprobs else 0) for d in ds])
        logprobs = array(_F32, [x for d in ds for x in d.logprobs])
        columns = [
            array(_U32, [len(d.ids) for d in ds]),
            array(_U32, [len(d.prefix) for d in ds]),
            array(_U32, [d.trim for d in ds]),
            array(_U32, [d.spec_counts[0] for d in ds]),
            array(_U32, [d.spec_counts[1] for d in ds]),
            array(_U32, [d.num_cached for d in ds]),
        ]
    except (KeyError, OverflowError, TypeError):
        return None
    if len(depths) != len(ids) or any(d.logprobs and len(d.logprobs) != len(d.ids) for d in ds):
        return None
    raw = joined.encode()
    header = _HEADER.pack(msg.load.kv_usage, msg.load.requests, len(ds), len(ids), len(prefix), len(raw))
    parts = [_OUTPUTS, header, raw, *(c.tobytes() for c in columns), ids.tobytes(), prefix.tobytes()]
    return b"".join(parts + [finish.tobytes(), depths.tobytes(), logprobs.tobytes()])


def _decode_outputs(buf: bytes) -> Outputs:
    view = memoryview(buf)
    kv_usage, requests, n, n_ids, n_prefix, n_raw = _HEADER.unpack_from(view, 1)
    at = 1 + _HEADER.size

    def take(code: str, count: int) -> list:
        nonlocal at
        col = array(code)
        col.frombytes(view[at : at + count * col.itemsize])
        at += count * col.itemsize
        return col.tolist()

    rids = bytes(view[at : at + n_raw]).decode().split("\0") if n else []
    at += n_raw
    counts, prefix_counts, trims, drafted, accepted, cached = (take(_U32, n) for _ in range(6))
    ids, prefix = take(_I32, n_ids), take(_I32, n_prefix)
    finish, depths = take(_U8, n), take(_U8, n_ids)
    n_logprobs = sum(counts[k] for k in range(n) if finish[k] & _WITH_LOGPROBS)
    logprobs = take(_F32, n_logprobs)
    if at != len(buf) or len(rids) != n:
        raise ValueError(f"a malformed Outputs frame ({len(buf)} bytes, {at} read, {len(rids)} ids for {n})")
    deltas = []
    i = j = m = 0
    for k in range(n):
        c, p = counts[k], prefix_counts[k]
        lp = logprobs[m : m + c] if finish[k] & _WITH_LOGPROBS else ()
        m += len(lp)
        deltas.append(
            Delta(
                rids[k],
                ids[i : i + c],
                depths[i : i + c],
                prefix[j : j + p],
                trims[k],
                _FINISH[finish[k] & ~_WITH_LOGPROBS],
                (drafted[k], accepted[k]),
                cached[k],
                lp,
            )  # fmt: skip
        )
        i, j = i + c, j + p
    return Outputs(deltas, Load(requests, kv_usage))


def encode(msg: Any) -> bytes:
    """A message as the bytes `send_message` sends."""
    if isinstance(msg, Outputs):
        frame = _encode_outputs(msg)
        if frame is not None:
            return frame
    return _PICKLED + pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def decode(buf: bytes) -> Any:
    """The message `encode` made these bytes from. Raises ValueError for bytes it did not make."""
    kind = buf[:1]
    if kind == _OUTPUTS:
        return _decode_outputs(buf)
    if kind == _PICKLED:
        return pickle.loads(memoryview(buf)[1:])
    raise ValueError(f"not a message: first byte {kind!r}")


def send_message(conn: Connection, msg: Any) -> None:
    """Send one message (the caller serializes concurrent senders of one connection)."""
    conn.send_bytes(encode(msg))


def recv_message(conn: Connection) -> Any:
    """The next message; EOFError / OSError when the connection ended."""
    return decode(conn.recv_bytes())
