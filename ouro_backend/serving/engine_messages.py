"""What an engine process and its peers say to each other: one frozen dataclass per message, pickled by
multiprocessing.connection. Receivers dispatch on the class (`match` / isinstance).

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

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, NamedTuple

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
    prefix: list
    trim: int
    finish_reason: str | None
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
    rid: str  # an unknown or finished request is ignored (the engine does not check whose it is)


@dataclass(frozen=True, slots=True)
class CountError:
    """The client answered one of its requests with an error of its own (for the engine's metrics)."""


ToEngine = AddRequest | AbortRequest | CountError
FromEngine = Outputs | LoadReport | Rejected | Failed | Stats  # EngineClient's on_message gets these (Stats: the owner)
