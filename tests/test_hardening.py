"""One request must not harm the others, against a REAL tritonserver (the launcher's TritonServer on free
ports, the toy checkpoint, CPU): input limits checked before any work (a 10 MB prompt, integers past 32
bits, an exit_trace longer than the engine holds), abort by id only with the id the server generated, and
the serving limits: a request timeout and a cap on waiting requests, shown with a stalled (SIGSTOP) engine.
Crash containment and local privacy: tests/test_supervisor.py."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from helpers import find_engine_process, processes
from server_common import START_TIMEOUT_S

from client.ouro_client import GrpcStream, request_options
from ouro_backend import LLM, SamplingParams
from ouro_backend.entrypoints.tritonserver import ServerError, TritonServer, free_port

pytestmark = pytest.mark.timeout(300)

SERVER_TIMEOUT_S = 120.0
TIMEOUT_S = 3.0  # the stalled-engine test's own requests' Triton `timeout`: shorter, so it wins
ENGINE_ARGS = {
    "device": "cpu",
    "dtype": "float32",
    "max_num_seqs": "4",
    "max_waiting_requests": "2",
    "request_timeout_s": str(SERVER_TIMEOUT_S),
}
PROMPT = "Once upon a time there was a little robot who"


@pytest.fixture(scope="module")
def server(toy_path):
    try:
        from ouro_backend.entrypoints.tritonserver import find_tritonserver

        find_tritonserver()
    except ServerError as e:
        pytest.skip(f"no tritonserver available: {e}")
    srv = TritonServer(
        model=toy_path,
        http_port=free_port(),
        grpc_port=free_port(),
        metrics_port=free_port(),
        engine_args=ENGINE_ARGS,
        address="127.0.0.1",
    )
    print(f"\ntritonserver log: {srv.log_file}", flush=True)
    try:
        srv.start(timeout=START_TIMEOUT_S)
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def llm(toy_path):
    return LLM(toy_path, device="cpu", dtype="float32")


def generate(server, model, body, timeout=60):
    """(HTTP status, parsed JSON body) of one /generate call."""
    req = urllib.request.Request(
        f"http://{server.http_url}/v2/models/{model}/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def metric(server, name) -> float:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def front_rss_mib(server) -> list[float]:
    """Resident memory of each `ouro` stub process of the server."""
    out = []
    for pid, args in processes():
        try:
            if not (b"triton_python_backend_stub" in args[0] and args[1].endswith(b"/ouro/1/model.py")):
                continue
            with open(f"/proc/{pid}/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
            if int(status["PPid"]) == server.proc.pid:
                out.append(int(status["VmRSS"].split()[0]) / 1024)
        except (OSError, IndexError):
            continue
    return out


def stream_in_background(server, prompt, max_tokens):
    """A greedy gRPC stream to `ouro` on its own thread; returns (thread, result holder)."""
    result: dict = {}

    def run():
        stream = GrpcStream(server.grpc_url)
        try:
            chunks = list(
                stream.request(
                    "ouro",
                    prompt,
                    request_options(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, return_finish_reason=True),
                )
            )
            result["text"] = "".join(c.text for c in chunks)
            result["reason"] = chunks[-1].finish_reason
        except Exception as e:
            result["error"] = str(e)
        finally:
            stream.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, result


def wait_idle(server, timeout=30.0):
    deadline = time.monotonic() + timeout
    while (
        metric(server, "ouro_num_requests_running")
        or metric(server, "ouro_num_requests_waiting")
        or metric(server, "ouro_kv_cache_usage_ratio")
    ):
        assert time.monotonic() < deadline, "the engine did not become idle"
        time.sleep(0.2)


def test_a_too_long_exit_trace_is_refused_and_other_streams_carry_on(server, llm):
    prompts = [f"{PROMPT} {i}" for i in range(3)]
    ref = [o.text for o in llm.generate(prompts, SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))]
    running = [stream_in_background(server, p, 48) for p in prompts]
    for model in ("ouro", "ouro_ensemble"):
        status, body = generate(server, model, {"text_input": PROMPT, "max_tokens": 4, "exit_trace": [1] * 65})
        assert status == 400 and "exit_trace" in body["error"] and "64" in body["error"], body
    for t, _result in running:
        t.join(120)
    assert [r.get("text") for _, r in running] == ref, [r for _, r in running]
    assert all(r["reason"] == "length" for _, r in running)


def test_a_10_mb_prompt_is_refused_fast_without_growing_the_front(server):
    for _ in range(4):  # both front instances have served (what they import on first use is not growth)
        assert generate(server, "ouro", {"text_input": PROMPT, "max_tokens": 2})[0] == 200
    before = front_rss_mib(server)
    body = {"text_input": "a" * (10 << 20), "max_tokens": 4}
    for model in ("ouro", "ouro_ensemble"):
        t0 = time.monotonic()
        status, reply = generate(server, model, body)
        elapsed = time.monotonic() - t0
        assert status == 400 and "text_input is 10485760 bytes" in reply["error"], reply
        assert elapsed < 2.0, f"{model}: refused after {elapsed:.1f}s"
    after = front_rss_mib(server)
    assert len(before) == len(after) == 2
    assert sum(after) - sum(before) < 100, (before, after)
    status, reply = generate(server, "ouro", {"text_input": PROMPT, "max_tokens": 4})
    assert status == 200 and reply["text_output"].startswith(PROMPT)


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("max_tokens", 2**32 + 3, "max_tokens \\(4294967299\\) exceeds the context limit"),
        ("max_tokens", 2**31, "max_tokens \\(2147483648\\) exceeds the context limit"),
        ("min_loops", 2**32 + 1, "min_loops"),
        ("max_loops", 2**32 + 2, "max_loops"),
    ],
)
def test_integers_past_32_bits_are_seen_and_refused(server, field, value, match):
    """Triton casts a JSON number to the declared type unchecked; INT64 inputs let the model see it."""
    for model in ("ouro", "ouro_ensemble"):
        status, body = generate(server, model, {"text_input": PROMPT, "max_tokens": 3, field: value})
        assert status == 400, body
        assert re.search(match, body["error"]), body


def test_top_k_past_32_bits_is_not_wrapped(server):
    """2^32 + 1 must not become top_k=1 (greedy): it is refused or means what it says."""
    status, body = generate(server, "ouro", {"text_input": PROMPT, "max_tokens": 3, "top_k": 2**32 + 1})
    assert status == 400 and "top_k" in body["error"], body


def _engine_stream(server, inputs):
    """Open a gRPC stream to ouro_engine with `inputs`; returns (client, queue of (result, error))."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_url)
    q: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    client.async_stream_infer("ouro_engine", inputs, enable_empty_final_response=True)
    return client, q


def _tensor(name, arr, dtype):
    import tritonclient.grpc as grpcclient

    t = grpcclient.InferInput(name, list(arr.shape), dtype)
    t.set_data_from_numpy(arr)
    return t


def _engine_request(max_tokens, request_id=None):
    inputs = [
        _tensor("input_ids", np.array([[5, 6, 7, 8]], np.int32), "INT32"),
        _tensor("max_tokens", np.array([[max_tokens]], np.int64), "INT64"),
        _tensor("ignore_eos", np.array([[True]]), "BOOL"),
        _tensor("stream", np.array([[True]]), "BOOL"),
    ]
    if request_id is not None:
        inputs.append(_tensor("request_id", np.array([[request_id.encode()]], np.object_), "BYTES"))
    return inputs


def _abort(server, rid) -> str:
    """The error of an abort control request for `rid`, or "" when it was accepted."""
    client, q = _engine_stream(
        server,
        [
            _tensor("input_ids", np.zeros((1, 0), np.int32), "INT32"),
            _tensor("abort_request_id", np.array([[rid.encode()]], np.object_), "BYTES"),
        ],
    )
    try:
        result, error = q.get(timeout=30)
        return str(error) if error is not None else ""
    finally:
        client.stop_stream()
        client.close()


def _drain(q, timeout=120.0):
    """(token count, finish reason, request_id output, error) of one ouro_engine stream."""
    tokens, reason, rid = 0, None, None
    deadline = time.monotonic() + timeout
    while True:
        result, error = q.get(timeout=max(0.1, deadline - time.monotonic()))
        if error is not None:
            return tokens, reason, rid, str(error)
        out = result.as_numpy("output_ids")
        if out is not None:
            tokens += out.size
            rid = rid or result.as_numpy("request_id").reshape(-1)[0].decode()
            reason = result.as_numpy("finish_reason").reshape(-1)[0].decode() or reason
        if result.get_response().parameters["triton_final_response"].bool_param:
            return tokens, reason, rid, None


def test_abort_by_id_takes_only_the_id_the_server_generated(server):
    # Another client knows (or guesses) a chosen request_id: aborting by it is refused, the request runs on.
    victim, q = _engine_stream(server, _engine_request(200, request_id="victim-1"))
    try:
        time.sleep(0.3)
        error = _abort(server, "victim-1")
        assert "not an id this model generated" in error, error
        tokens, reason, rid, error = _drain(q)
        assert (tokens, reason, rid, error) == (200, "length", "victim-1", None)
    finally:
        victim.stop_stream()
        victim.close()
    # The owner holds the generated id from the first response: aborting with it cancels the request.
    owner, q = _engine_stream(server, _engine_request(2000))
    try:
        result, error = q.get(timeout=60)
        assert error is None
        rid = result.as_numpy("request_id").reshape(-1)[0].decode()
        assert rid.startswith("ouro-engine-") and len(rid) == len("ouro-engine-") + 32
        assert _abort(server, rid) == ""
        tokens, reason, _, error = _drain(q)
        assert error is None and reason == "cancelled" and tokens < 2000
    finally:
        owner.stop_stream()
        owner.close()
    assert "may not start with" in _abort_chosen_generated_prefix(server)
    wait_idle(server)


def _abort_chosen_generated_prefix(server) -> str:
    client, q = _engine_stream(server, _engine_request(4, request_id="ouro-engine-" + "0" * 32))
    try:
        return str(q.get(timeout=30)[1])
    finally:
        client.stop_stream()
        client.close()


def test_a_stalled_engine_times_requests_out_and_refuses_more_than_it_may_queue(server):
    """Each `ouro` instance admits max_num_seqs + max_waiting_requests (6) requests per engine, counted by
    itself; a stalled engine reports nothing, so 2 instances let through 12 and refuse the rest at once.
    Those admitted end with a timeout error TIMEOUT_S after they arrived; nothing is left behind."""
    engine = _engine_pid(server)
    os.kill(engine, signal.SIGSTOP)
    results: list = [None] * 16
    try:

        def one(i):
            t0 = time.monotonic()
            try:
                status, body = generate(
                    server,
                    "ouro",
                    {"text_input": f"{PROMPT} {i}", "max_tokens": 8, "timeout": int(TIMEOUT_S * 1e6)},
                    timeout=60,
                )
            except OSError as e:
                status, body = 0, {"error": f"no answer: {e}"}
            results[i] = (time.monotonic() - t0, status, body.get("error", ""))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        os.kill(engine, signal.SIGCONT)
    busy = [r for r in results if "server busy" in r[2]]
    timed_out = [r for r in results if "request timed out" in r[2]]
    assert len(busy) + len(timed_out) == 16, results
    # Refused without waiting for anything: before any admitted request could have timed out.
    assert len(busy) >= 4 and all(r[0] < TIMEOUT_S for r in busy), busy
    assert all(TIMEOUT_S - 0.1 <= r[0] < TIMEOUT_S + 5.0 for r in timed_out), timed_out
    assert all(r[1] == 400 for r in results)  # Triton 2.51 answers every error of a decoupled model with 400
    wait_idle(server)
    # The engine's metrics can read idle a moment before each front has counted its timed-out requests'
    # ends (a front's admission count follows the engine's messages): the server must serve again soon.
    deadline = time.monotonic() + 10
    while (r := generate(server, "ouro", {"text_input": PROMPT, "max_tokens": 4}))[0] != 200:
        assert "server busy" in r[1].get("error", "") and time.monotonic() < deadline, r
        time.sleep(0.2)


def _engine_pid(server) -> int:
    pid = find_engine_process(f"engine-{server.proc.pid}-")
    assert pid, "no engine process"
    return pid


def test_an_engine_killed_while_it_restarts_comes_back(server):
    first = _engine_pid(server)
    os.kill(first, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while (second := find_engine_process(f"engine-{server.proc.pid}-", {first})) == 0:
        assert time.monotonic() < deadline, "no new engine process"
        time.sleep(0.01)
    os.kill(second, signal.SIGKILL)  # while it loads
    while True:
        status, body = generate(server, "ouro", {"text_input": PROMPT, "max_tokens": 4})
        if status == 200:
            break
        assert time.monotonic() < deadline, f"not served again: {body}"
        time.sleep(0.5)
    assert _engine_pid(server) not in (first, second)
    assert "restart attempt 1 failed" in server.log_text()
