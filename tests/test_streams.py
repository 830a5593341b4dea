"""The streaming layer the two decoupled models share (ouro_backend.serving.streams), without a server:
a stand-in for `triton_python_backend_utils` records what each response sender was given.
Covers coalescing while a send waits, order, first responses first, FINAL, non-streaming, engine rejections and
failures, a lost
engine, cancellation and the typed options."""

from __future__ import annotations

import threading
import time
import types

import pytest

from ouro_backend.config import ConfigError
from ouro_backend.sampling_params import RequestError, SamplingParams
from ouro_backend.serving import protocol
from ouro_backend.serving.cancellation import CancelWatcher
from ouro_backend.serving.engine_messages import Delta, Failed, Load, LoadReport, Outputs, Rejected
from ouro_backend.serving.engine_pool import EngineRouter
from ouro_backend.serving.options import FrontOptions, ServingOptions, typed_options
from ouro_backend.serving.streams import SendQueue, StreamingModel

FINAL = 1
IDLE = Load(0, 0.0)


class TritonError(str):
    """pb_utils.TritonError's stand-in: compares as its message and keeps its code."""

    UNAVAILABLE = "UNAVAILABLE"

    def __new__(cls, message, code=None):
        error = super().__new__(cls, message)
        error.code = code
        return error


def fake_pb():
    pb = types.SimpleNamespace(TRITONSERVER_RESPONSE_COMPLETE_FINAL=FINAL)
    pb.Tensor = lambda name, arr: (name, arr)
    pb.TritonError = TritonError
    pb.InferenceResponse = lambda output_tensors, error=None: dict(outputs=dict(output_tensors), error=error)
    return pb


class Sender:
    """Records responses; the first `send` waits for `gate` when one is given (a busy server)."""

    def __init__(self, gate: threading.Event = None):
        self.sent: list[tuple[dict, int]] = []
        self.gate = gate
        self.cancelled = False
        self.finished = threading.Event()
        self.asked_after_final = 0  # an assert here would only reach the watcher thread's log

    def send(self, response=None, flags=0):
        if self.gate is not None:
            self.gate.wait(10)
            self.gate = None
        self.sent.append((response, flags))
        if flags & FINAL:
            self.finished.set()

    def is_cancelled(self):
        self.asked_after_final += self.finished.is_set()  # is_cancelled() after FINAL crashes tritonserver 2.51
        return self.cancelled

    def tokens(self):
        return [int(t) for r, _ in self.sent if r and r["outputs"] for t in r["outputs"]["output_ids"].reshape(-1)]


class Client:
    closed = False

    def __init__(self, capacity=1000, request_timeout_s=0.0):
        self.added, self.aborted = [], []
        self.info = types.SimpleNamespace(
            capacity=capacity, max_num_seqs=capacity, max_waiting_requests=0, request_timeout_s=request_timeout_s
        )

    def add(self, rid, ids, params):
        self.added.append((rid, ids, params))

    def abort(self, rid):
        self.aborted.append(rid)


class Model(StreamingModel):
    model_name = "test"

    def __init__(self, threads=2, cancel_interval=0.01, stream_interval=0):
        self.client = Client()
        self.router = EngineRouter(1)
        self.router.set_client(0, self.client)
        options = ServingOptions(
            cancel_check_interval_s=cancel_interval, response_threads=threads, stream_interval=stream_interval
        )
        self.setup_streams(fake_pb(), options)

    def parse(self, request):
        stream, rid, interval = request.payload
        parsed = protocol.ParsedRequest(
            [1, 2, 3],
            SamplingParams(max_tokens=8),
            stream=stream,
            exclude_input_in_output=True,
            return_finish_reason=True,
            stream_interval=interval,
        )
        return parsed, [1, 2, 3], rid


class Request:
    def __init__(self, sender, stream=True, rid="r", timeout_us=0, interval=None):
        self.sender, self.payload, self.timeout_us = sender, (stream, rid, interval), timeout_us

    def get_response_sender(self):
        return self.sender

    def timeout(self):
        return self.timeout_us

    def parameters(self):
        return "{}"


def delta(rid, ids, reason=None):
    return Delta(rid, ids, [4] * len(ids), [9], 0, reason)


def wait(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


@pytest.fixture
def model():
    m = Model()
    yield m
    m.close_streams("closed")


def test_streaming_coalesces_while_a_send_waits_and_keeps_order(model):
    gate = threading.Event()
    sender = Sender(gate)
    model.execute([Request(sender)])
    assert model.client.added[0][0] == "r" and model.client.added[0][1] == [1, 2, 3]
    model.on_engine_message(0, Outputs([delta("r", [10])], IDLE))
    wait(lambda: sender.gate is gate and model._streams["r"].queued is False)  # the sender holds [10]
    for t in (11, 12, 13):
        model.on_engine_message(0, Outputs([delta("r", [t])], IDLE))
    model.on_engine_message(0, Outputs([delta("r", [14], "length")], IDLE))
    gate.set()
    assert sender.finished.wait(5)
    assert sender.tokens() == [10, 11, 12, 13, 14]
    assert len(sender.sent) == 2, "what piled up during the first send goes out as one response"
    flags = [f for _, f in sender.sent]
    assert flags == [0, FINAL]
    last = sender.sent[-1][0]["outputs"]
    assert list(last["exit_depths"].reshape(-1)) == [4] * 4
    assert last["finish_reason"][0][0] == b"length"
    assert "r" not in model._streams


def _pieces(sender):
    """(output ids, prefix ids, exit depths, final) of each response."""
    out = []
    for r, flags in sender.sent:
        o = r["outputs"]
        ids = [int(t) for t in o["output_ids"].reshape(-1)]
        prefix = [int(t) for t in o["prefix_ids"].reshape(-1)]
        out.append((ids, prefix, [int(d) for d in o["exit_depths"].reshape(-1)], bool(flags & FINAL)))
    return out


def test_stream_interval_one_sends_every_token_alone_even_when_behind(model):
    """A request's stream_interval 1: what piles up during a send goes out as one response per token, each
    with its own exit depth and the ids before it as detokenization context."""
    gate = threading.Event()
    sender = Sender(gate)
    model.execute([Request(sender, interval=1)])
    model.on_engine_message(0, Outputs([delta("r", [10])], IDLE))
    wait(lambda: sender.gate is gate and model._streams["r"].queued is False)
    # a speculative step's two tokens, with the engine's context (the ids before them)
    model.on_engine_message(0, Outputs([Delta("r", [11, 12], [4, 4], [9, 10], 0, None)], IDLE))
    model.on_engine_message(0, Outputs([delta("r", [13])], IDLE))
    model.on_engine_message(0, Outputs([delta("r", [14], "length")], IDLE))
    gate.set()
    assert sender.finished.wait(5)
    got = _pieces(sender)
    assert [ids for ids, *_ in got] == [[10], [11], [12], [13], [14]]
    assert [d for _, _, d, _ in got] == [[4]] * 5
    assert [f for *_, f in got] == [False] * 4 + [True]
    # the engine's context for 11 was [9, 10]; each later piece's is the ids just before it
    assert [p for _, p, _, _ in got[1:]] == [[9, 10], [9, 10, 11], [9, 10, 11, 12], [9, 10, 11, 12, 13]]


def test_the_stream_keeps_the_detokenization_context_the_engine_sends_once(model):
    """The engine sends a request's prefix (its prompt's last ids) only with its first tokens: every later
    response's context is the ids before it, kept by the stream, coalesced or not."""
    gate = threading.Event()
    sender = Sender(gate)
    model.execute([Request(sender)])
    model.on_engine_message(0, Outputs([Delta("r", [10], [4], [6, 7, 8], 0, None)], IDLE))
    wait(lambda: sender.gate is gate and model._streams["r"].queued is False)
    for t in (11, 12):  # coalesced into one response while the first send waits
        model.on_engine_message(0, Outputs([Delta("r", [t], [4], [], 0, None)], IDLE))
    gate.set()
    wait(lambda: len(sender.sent) == 2)
    model.on_engine_message(0, Outputs([Delta("r", [13], [4], [], 0, "length")], IDLE))
    assert sender.finished.wait(5)
    got = _pieces(sender)
    assert [ids for ids, *_ in got] == [[10], [11, 12], [13]]
    assert [p for _, p, _, _ in got] == [[6, 7, 8], [6, 7, 8, 10], [7, 8, 10, 11, 12]]  # PREFIX_WINDOW ids


def test_stream_interval_n_waits_for_n_tokens_and_ends_with_the_rest():
    """The server's stream_interval 3 (no request value): responses of exactly 3 tokens; a shorter
    remainder waits for more tokens and goes out with the final response."""
    model = Model(stream_interval=3)
    try:
        sender = Sender()
        model.execute([Request(sender)])
        for t in (10, 11):
            model.on_engine_message(0, Outputs([delta("r", [t])], IDLE))
        time.sleep(0.05)
        assert sender.sent == [], "two tokens are short of the interval"
        for t in (12, 13, 14, 15):
            model.on_engine_message(0, Outputs([delta("r", [t])], IDLE))
        wait(lambda: len(sender.sent) == 2)
        model.on_engine_message(0, Outputs([delta("r", [16], "stop")], IDLE))
        assert sender.finished.wait(5)
        assert [ids for ids, *_ in _pieces(sender)] == [[10, 11, 12], [13, 14, 15], [16]]
        # a request's own value wins over the server's: 0 sends whatever is waiting
        other = Sender()
        model.execute([Request(other, rid="o", interval=0)])
        model.on_engine_message(0, Outputs([delta("o", [20])], IDLE))
        wait(lambda: len(other.sent) == 1)
        model.on_engine_message(0, Outputs([delta("o", [21], "length")], IDLE))
        assert other.finished.wait(5) and other.tokens() == [20, 21]
    finally:
        model.close_streams("closed")


def test_stream_interval_keeps_a_stop_strings_trim_in_one_final_response(model):
    gate = threading.Event()
    sender = Sender(gate)
    model.execute([Request(sender, interval=1)])
    model.on_engine_message(0, Outputs([delta("r", [10])], IDLE))
    wait(lambda: sender.gate is gate and model._streams["r"].queued is False)
    model.on_engine_message(0, Outputs([delta("r", [11, 12])], IDLE))
    model.on_engine_message(0, Outputs([Delta("r", [13], [4], [9], 2, "stop")], IDLE))
    gate.set()
    assert sender.finished.wait(5)
    got = _pieces(sender)
    assert [ids for ids, *_ in got] == [[10], [11, 12, 13]]
    assert int(sender.sent[-1][0]["outputs"]["trim_chars"].reshape(-1)[0]) == 2


def test_send_queue_takes_first_responses_first_each_lane_in_order():
    q = SendQueue()
    for item, first in (("c1", False), ("b1", True), ("c2", False), ("b2", True)):
        q.put(item, first=first)
    assert [q.get() for _ in range(4)] == ["b1", "b2", "c1", "c2"]


def test_a_first_token_does_not_wait_behind_other_requests_later_tokens():
    """One sender thread, busy with a send: a request's first response goes out before another request's
    later tokens that were waiting longer (served TTFT on a busy server)."""
    model = Model(threads=1)
    order: list[str] = []

    class Logged(Sender):
        def __init__(self, name, gate=None):
            super().__init__(gate)
            self.name = name

        def send(self, response=None, flags=0):
            super().send(response, flags)
            order.append(self.name)

    try:
        gate = threading.Event()
        early, busy, new = Logged("early"), Logged("busy", gate), Logged("new")
        model.execute([Request(early, rid="early")])
        model.on_engine_message(0, Outputs([delta("early", [10])], IDLE))
        wait(lambda: order == ["early"])
        model.execute([Request(busy, rid="busy")])
        model.on_engine_message(0, Outputs([delta("busy", [20])], IDLE))
        wait(lambda: busy.gate is gate and model._streams["busy"].queued is False)  # the one sender waits
        model.on_engine_message(0, Outputs([delta("early", [11])], IDLE))  # a later token: waits first
        model.execute([Request(new, rid="new")])
        model.on_engine_message(0, Outputs([delta("new", [30])], IDLE))  # a first token: comes after
        gate.set()
        wait(lambda: len(order) == 4)
        assert order == ["early", "busy", "new", "early"]
        assert new.tokens() == [30] and early.tokens() == [10, 11]
    finally:
        model.close_streams("closed")


def test_non_streaming_gets_one_response(model):
    sender = Sender()
    model.execute([Request(sender, stream=False)])
    for t in (10, 11):
        model.on_engine_message(0, Outputs([delta("r", [t])], IDLE))
    time.sleep(0.05)
    assert sender.sent == []
    model.on_engine_message(0, Outputs([delta("r", [12], "stop")], IDLE))
    assert sender.finished.wait(5)
    assert len(sender.sent) == 1 and sender.tokens() == [10, 11, 12] and sender.sent[0][1] == FINAL


def test_many_streams_each_in_order(model):
    senders = {f"r{i}": Sender() for i in range(16)}
    model.execute([Request(s, rid=rid) for rid, s in senders.items()])
    for step in range(20):
        model.on_engine_message(
            0, Outputs([delta(rid, [step], "length" if step == 19 else None) for rid in senders], IDLE)
        )
    for s in senders.values():
        assert s.finished.wait(5)
        assert s.tokens() == list(range(20))


def test_rejected_and_failed_requests_get_errors(model):
    a, b_ = Sender(), Sender()
    model.execute([Request(a, rid="a"), Request(b_, rid="b")])
    model.on_engine_message(0, Rejected("a", "prompt too long", "invalid"))
    model.on_engine_message(0, Failed(["b"], "engine error: boom"))
    assert a.finished.wait(5) and b_.finished.wait(5)
    assert a.sent == [(dict(outputs={}, error="test: invalid request: prompt too long"), FINAL)]
    assert b_.sent[0][0]["error"] == "test: engine error: boom"
    assert not model._streams


def test_requests_past_their_timeout_end_with_an_error_and_are_aborted():
    """A stalled engine sends nothing: the watcher ends each request at its deadline (the server's
    request_timeout_s, or the request's own Triton timeout when shorter) and aborts it in the engine."""
    m = Model()
    m.client.info.request_timeout_s = 0.3
    m.router.set_client(0, m.client)
    try:
        slow, quick, fine = Sender(), Sender(), Sender()
        t0 = time.monotonic()
        m.execute(
            [Request(slow, rid="slow"), Request(quick, rid="quick", timeout_us=100_000), Request(fine, rid="fine")]
        )
        m.on_engine_message(0, Outputs([delta("fine", [5], "length")], IDLE))
        assert quick.finished.wait(5)
        t_quick = time.monotonic() - t0
        assert slow.finished.wait(5)
        t_slow = time.monotonic() - t0
        assert 0.1 <= t_quick < t_slow and t_slow >= 0.3
        for sender, limit in ((slow, "0.3s"), (quick, "0.1s")):
            ((response, flags),) = sender.sent
            assert (
                flags == FINAL
                and response["error"] == f"test: request timed out: not finished {limit} after it arrived"
            )
            assert response["error"].code == "UNAVAILABLE"
        assert fine.tokens() == [5] and fine.sent[-1][0]["error"] is None
        assert sorted(m.client.aborted) == ["quick", "slow"]
        assert not m._streams and m.router.load(0) == 0
    finally:
        m.close_streams("closed")


def test_over_capacity_is_refused_at_once_as_busy():
    """The client's own count refuses requests beyond the engine's capacity (running + waiting) without
    asking the engine, which may be stalled; the engine's own refusal is a busy error too."""
    m = Model()
    m.client.info.capacity = 2
    try:
        senders = [Sender() for _ in range(3)]
        m.execute([Request(s, rid=f"r{i}") for i, s in enumerate(senders)])
        ((response, flags),) = senders[2].sent
        assert response["error"].startswith("test: server busy") and response["error"].code == "UNAVAILABLE"
        assert [rid for rid, *_ in m.client.added] == ["r0", "r1"]
        m.on_engine_message(0, Rejected("r1", "server busy: 1 requests running", "busy"))
        assert senders[1].finished.wait(5)
        assert senders[1].sent[0][0]["error"] == "test: server busy: 1 requests running"
        assert senders[1].sent[0][0]["error"].code == "UNAVAILABLE"
        m.on_engine_message(0, Outputs([delta("r0", [1], "length")], IDLE))
        assert senders[0].finished.wait(5)
        late = Sender()  # room again
        m.execute([Request(late, rid="late")])
        assert late.sent == [] and m.client.added[-1][0] == "late"
    finally:
        m.close_streams("closed")


def test_lost_engine_ends_open_requests_and_refuses_new_ones(model):
    a = Sender()
    model.execute([Request(a, rid="a")])
    model.client.closed = True
    model.on_engine_closed(0)
    assert a.finished.wait(5) and "engine process exited" in a.sent[0][0]["error"]
    c = Sender()
    model.execute([Request(c, rid="c")])
    assert c.sent[0][0]["error"] == "test: the engine process is gone (exited and restarting); see the server log"


def test_duplicate_request_id_is_refused(model):
    a, b_ = Sender(), Sender()
    model.execute([Request(a, rid="same"), Request(b_, rid="same")])
    assert "already running" in b_.sent[0][0]["error"] and a.sent == []
    assert len(model.client.added) == 1


def test_cancelled_client_aborts_the_engine_request(model):
    a = Sender()
    model.execute([Request(a, rid="a")])
    a.cancelled = True
    wait(lambda: model.client.aborted == ["a"])
    model.on_engine_message(0, Outputs([delta("a", [], "abort")], IDLE))
    assert a.finished.wait(5)
    assert a.sent[-1][0]["outputs"]["finish_reason"][0][0] == b"cancelled" and a.sent[-1][1] == FINAL
    time.sleep(0.05)  # several watcher intervals: it must not ask the sender again
    assert model.client.aborted == ["a"] and a.asked_after_final == 0


def test_watcher_never_asks_a_finished_request():
    """A stream whose FINAL went out between the watcher listing it and asking it: not asked."""
    s = types.SimpleNamespace(sender=Sender(), send_lock=threading.Lock(), done=True)
    s.sender.cancelled = True
    s.sender.finished.set()
    assert not CancelWatcher._client_cancelled(s) and s.sender.asked_after_final == 0
    s.done, s.sender = False, Sender()
    s.sender.cancelled = True
    assert CancelWatcher._client_cancelled(s)


@pytest.mark.parametrize(
    "error, message",
    [
        (RequestError("cannot detokenize"), "test: cannot detokenize"),
        (KeyError("bug"), "test: internal error: KeyError: 'bug'"),
    ],
)
def test_bad_response_conversion_ends_the_request_and_aborts_it(error, message):
    class Failing(Model):
        def response_arrays(self, fields, rid):
            raise error

    m = Failing()
    try:
        a = Sender()
        m.execute([Request(a, rid="a")])
        m.on_engine_message(0, Outputs([delta("a", [1])], IDLE))
        assert a.finished.wait(5)
        assert a.sent[0][0]["error"] == message and m.client.aborted == ["a"]
        m.on_engine_message(0, Outputs([delta("a", [2], "abort")], IDLE))  # the engine's last word is dropped
        time.sleep(0.05)
        assert len(a.sent) == 1
    finally:
        m.close_streams("closed")


def test_unload_answers_open_requests():
    m = Model()
    a = Sender()
    m.execute([Request(a, rid="a")])
    m.close_streams("test: the model is being unloaded")
    assert a.sent == [(dict(outputs={}, error="test: the model is being unloaded"), FINAL)]


def test_typed_options():
    assert typed_options(ServingOptions, {}) == ServingOptions()
    opts = typed_options(FrontOptions, {"engine_model": "eng", "response_threads": "3", "EXECUTION_ENV_PATH": "/x"})
    assert opts.engine_model == "eng" and opts.response_threads == 3
    for cls, values, match in [
        (ServingOptions, {"response_threads": "0"}, "response_threads=0 must be > 0"),
        (ServingOptions, {"cancel_check_interval_s": "soon"}, "not a valid float"),
        (ServingOptions, {"engine_model": "x"}, "unknown parameter 'engine_model'"),
        (FrontOptions, {"metrics_interval_s": "1"}, "unknown parameter 'metrics_interval_s'"),
    ]:
        with pytest.raises(ConfigError, match=match):
            typed_options(cls, values)


# ------------------------------------------------------------------------------------------ several engines
class TwoEngineModel(Model):
    def __init__(self):
        super().__init__()
        self.clients = [Client(), Client()]
        self.router = EngineRouter(2)
        for i, c in enumerate(self.clients):
            self.router.set_client(i, c)


def test_requests_go_to_the_least_loaded_engine_and_a_lost_one_ends_only_its_own():
    m = TwoEngineModel()
    try:
        senders = {rid: Sender() for rid in "abcd"}
        m.execute([Request(s, rid=rid) for rid, s in senders.items()])
        assert [r[0] for r in m.clients[0].added] == ["a", "c"] and [r[0] for r in m.clients[1].added] == ["b", "d"]
        # engine 1 reports 5 requests of another client: the next two go to engine 0
        m.on_engine_message(1, LoadReport(Load(7, 0.5)))
        m.execute([Request(Sender(), rid="e"), Request(Sender(), rid="f")])
        assert [r[0] for r in m.clients[0].added] == ["a", "c", "e", "f"]
        senders["d"].cancelled = True  # cancellation reaches the engine that runs the request
        wait(lambda: m.clients[1].aborted == ["d"])
        m.on_engine_message(0, Outputs([delta("a", [1], "length")], Load(3, 0.1)))
        assert senders["a"].finished.wait(5) and m.router.load(0) == 3
        m.clients[1].closed = True
        m.on_engine_closed(1)
        assert senders["b"].finished.wait(5) and "engine process exited" in senders["b"].sent[0][0]["error"]
        assert not senders["c"].finished.is_set()  # engine 0's requests go on
        g = Sender()
        m.execute([Request(g, rid="g")])  # only engine 0 is live
        assert m.clients[0].added[-1][0] == "g" and g.sent == []
    finally:
        m.close_streams("closed")


def test_router_counts_its_own_requests_at_once_and_the_others_as_reported():
    r = EngineRouter(3)
    for i in range(3):
        r.set_client(i, Client())
    assert [r.pick()[0] for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    r.report(0, Load(10, 0.9))  # 2 of them ours: 8 more from other clients
    r.report(1, Load(2, 0.6))
    r.report(2, Load(2, 0.3))  # as many requests as engine 1, less KV in use: preferred
    assert r.pick()[0] == 2 and r.load(0) == 10
    r.release(0, 2)
    assert r.load(0) == 8
    r.clients[1].closed = True  # no connect callback: a closed engine is skipped
    assert {r.pick()[0] for _ in range(4)} == {2}
