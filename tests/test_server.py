"""End-to-end tests against a REAL tritonserver (Triton 2.51 from the nvidia-pytriton wheel, or $TRITONSERVER)
running the real engine on the toy checkpoint, started through the `ouro-serve` launcher code on free ports.

One server for the module; its log path is printed at start, and its tail on failure. Greedy results are
compared with the offline engine (`ouro_backend.LLM`) on the same checkpoint.
"""
from __future__ import annotations

import json
import os
import queue
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from client.ouro_client import GrpcStream, build_inputs, generate, request_options
from helpers import wait_for
from ouro_backend import LLM, SamplingParams
from ouro_backend.entrypoints.serve import ServerError, TritonServer, free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.timeout(300)

# The server's engine and the offline reference run the same device and dtype (fp32: greedy results are
# compared token for token). OURO_TEST_DEVICE=cuda runs both on the GPU.
DEVICE = os.environ.get("OURO_TEST_DEVICE", "cpu")
ENGINE_ARGS = {"device": DEVICE, "dtype": "float32"}
if DEVICE != "cpu":
    # A fixed KV size: automatic sizing would give the test process's offline engine 90% of the GPU and
    # leave the server's engine none.
    ENGINE_ARGS["num_blocks"] = 4096
# Tokens the engine may still make between a client's cancel and the abort (one watcher interval and a
# round): the toy makes a few hundred tokens/s on 2 CPU cores, thousands on a GPU.
MAX_AFTER_CANCEL = 200 if DEVICE == "cpu" else 1000
PROMPT = "Once upon a time there was a little robot who"
PROMPTS = [
    "Once upon a time there was a little robot who",
    "The quick brown fox jumps over the lazy dog.",
    " leading space and  two spaces",
    "héllo wörld: naïve café 🙂 你好，世界",
    "def add(a, b):\n    return",
    "Questions and answers: What is the capital of France?",
    "The weather today is sunny with a few clouds",
    "Le café est très bon ce matin. Où est",
]


def _server_or_skip(**kwargs) -> TritonServer:
    try:
        from ouro_backend.entrypoints.serve import find_tritonserver

        find_tritonserver()
    except ServerError as e:
        pytest.skip(f"no tritonserver available: {e}")
    return TritonServer(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(), **kwargs)


@pytest.fixture(scope="module")
def server(toy_path, request):
    srv = _server_or_skip(model=toy_path, engine_args=ENGINE_ARGS, address="127.0.0.1")  # this host only
    print(f"\ntritonserver log: {srv.log_file}", flush=True)
    try:
        srv.start(timeout=300)
    except ServerError:
        srv.stop()
        raise
    failed_before = request.session.testsfailed
    try:
        yield srv
    finally:
        code = srv.stop()
        log = srv.log_text()
        if request.session.testsfailed > failed_before:
            print(f"\n--- tritonserver log tail ({srv.log_file}) ---\n{srv.log_tail(100)}")
        # Shutdown must be clean: models unloaded, engine thread stopped, no Python errors.
        if "Traceback" in log:
            print(srv.log_tail(120))
        assert "Traceback" not in log, f"Python error in the server log {srv.log_file}"
        assert code == 0, f"tritonserver exit code {code}; log {srv.log_file}:\n{srv.log_tail()}"


@pytest.fixture(scope="module")
def llm(toy_path):
    return LLM(model=toy_path, **ENGINE_ARGS)


def offline(llm, prompt, **params):
    return llm.generate([prompt], SamplingParams(**params))[0]


def metrics(server) -> dict[str, float]:
    """The engine's own metrics (label model="ouro_engine"), summed over other labels."""
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    out: dict[str, float] = {}
    for name, labels, value in re.findall(r"^(ouro_[a-z0-9_]+)\{([^}]*)\} (\S+)$", text, re.M):
        if 'model="ouro_engine"' in labels:
            key = name
            le = re.search(r'le="([^"]+)"', labels)
            if name.endswith("_bucket") and le:
                key = name + "{" + le.group(1) + "}"
            out[key] = out.get(key, 0.0) + float(value)
    return out


def all_flags(**kw):
    return request_options(return_num_input_tokens=True, return_num_output_tokens=True, return_finish_reason=True,
                           **kw)


# ------------------------------------------------------------------------------------------- streaming


@pytest.mark.parametrize("model", ["ouro", "ouro_ensemble"])
def test_grpc_streaming_matches_offline(server, llm, model):
    ref = offline(llm, PROMPT, max_tokens=24, temperature=0.0, exit_threshold=0.7)
    assert len(set(ref.exit_depths)) > 1, "the toy should exit at mixed depths at threshold 0.7"
    r = generate(server.grpc_url, model, PROMPT, all_flags(max_tokens=24, temperature=0.0, exit_threshold=0.7))
    assert r.error is None
    assert len(r.chunks) > 1, "streaming must give several responses"
    assert r.text == ref.text
    assert r.exit_depths == ref.exit_depths
    assert sum(c.num_output_tokens for c in r.chunks) == len(ref.token_ids)
    assert all(c.num_output_tokens == len(c.exit_depths) for c in r.chunks)
    assert {c.num_input_tokens for c in r.chunks} == {len(ref.prompt_token_ids)}
    assert [c.finish_reason for c in r.chunks[:-1]] == [""] * (len(r.chunks) - 1)
    assert r.chunks[-1].finish_reason == ref.finish_reason


@pytest.mark.parametrize("model", ["ouro", "ouro_ensemble"])
def test_http_sse_streaming_matches_offline(server, llm, model):
    prompt = "héllo wörld: naïve café 🙂"
    ref = offline(llm, prompt, max_tokens=20, temperature=0.0)
    r = generate(server.http_url, model, prompt, all_flags(max_tokens=20, temperature=0.0), protocol="http")
    assert r.error is None
    assert len(r.chunks) > 1
    assert r.text == ref.text and r.exit_depths == ref.exit_depths
    assert set(r.exit_depths) == {4}  # default threshold 1.0: fixed depth
    assert r.num_tokens == len(ref.token_ids) and r.finish_reason == ref.finish_reason


@pytest.mark.parametrize("model", ["ouro", "ouro_ensemble"])
def test_prefix_cache_hits_are_reported_and_change_nothing(server, llm, model):
    """Prefix caching is on by default: a second request with the same long prompt reads its full blocks
    from the cache, says how many prompt tokens that was, and gets the same text."""
    prompt = f"{model}: " + " ".join(PROMPTS)  # long enough for several full 16-token blocks
    ref = offline(llm, prompt, max_tokens=8, temperature=0.0)
    opts = request_options(max_tokens=8, temperature=0.0, stream=True, return_num_cached_tokens=True,
                           return_num_input_tokens=True)
    first = generate(server.grpc_url, model, prompt, opts)
    second = generate(server.grpc_url, model, prompt, opts)
    assert first.error is None and second.error is None
    assert first.text == second.text == ref.text
    n = first.chunks[-1].num_input_tokens
    assert n == len(ref.prompt_token_ids) > 32
    assert first.chunks[-1].num_cached_tokens == 0
    assert second.chunks[-1].num_cached_tokens == (n - 1) // 16 * 16  # every full block but the last token's


def test_engine_direct_token_ids(server, llm):
    """ouro_engine is callable directly with token ids (gRPC streaming)."""
    import tritonclient.grpc as grpcclient

    ref = offline(llm, PROMPT, max_tokens=12, temperature=0.0, exit_threshold=0.5)
    ids = np.array([ref.prompt_token_ids], dtype=np.int32)
    inputs = []
    for name, arr, dt in [("input_ids", ids, "INT32"), ("max_tokens", np.array([[12]], np.int64), "INT64"),
                          ("temperature", np.array([[0.0]], np.float32), "FP32"),
                          ("exit_threshold", np.array([[0.5]], np.float32), "FP32"),
                          ("stream", np.array([[True]]), "BOOL")]:
        t = grpcclient.InferInput(name, list(arr.shape), dt)
        t.set_data_from_numpy(arr)
        inputs.append(t)
    client = grpcclient.InferenceServerClient(server.grpc_url)
    q: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    client.async_stream_infer("ouro_engine", inputs, enable_empty_final_response=True)
    out_ids, depths, reasons = [], [], []
    while True:
        result, error = q.get(timeout=60)
        assert error is None, error
        if result.get_response().outputs:
            out_ids += result.as_numpy("output_ids").reshape(-1).tolist()
            depths += result.as_numpy("exit_depths").reshape(-1).tolist()
            reasons.append(result.as_numpy("finish_reason").reshape(-1)[0].decode())
        if result.get_response().parameters["triton_final_response"].bool_param:
            break
    client.stop_stream()
    client.close()
    assert out_ids == ref.token_ids and depths == ref.exit_depths
    assert reasons[-1] == ref.finish_reason and set(reasons[:-1]) <= {""}


# ------------------------------------------------------------------------------------------- non-streaming


@pytest.mark.parametrize("model", ["ouro", "ouro_ensemble"])
def test_non_streaming(server, llm, model):
    prompt = " leading space, 🙂 and  two spaces"
    ref = offline(llm, prompt, max_tokens=16, temperature=0.0)
    # Default: one response, the prompt echoed before the generated text (like the vLLM / TRT-LLM backends).
    r = generate(server.http_url, model, prompt, all_flags(max_tokens=16, temperature=0.0, stream=False),
                 protocol="http")
    assert r.error is None and len(r.chunks) == 1
    assert r.text == prompt + ref.text
    assert r.exit_depths == ref.exit_depths and r.num_tokens == len(ref.token_ids)
    assert r.finish_reason == ref.finish_reason
    # exclude_input_in_output: only the generated text; and stream absent means non-streaming
    opts = {"max_tokens": 16, "temperature": 0.0, "exclude_input_in_output": True}
    r = generate(server.grpc_url, model, prompt, opts)
    assert r.error is None and len(r.chunks) == 1 and r.text == ref.text
    # streaming never echoes the prompt
    r = generate(server.grpc_url, model, prompt, dict(opts, stream=True, exclude_input_in_output=False))
    assert r.error is None and r.text == ref.text


def test_http_generate_plain_json(server, llm):
    ref = offline(llm, PROMPT, max_tokens=8, temperature=0.0)
    body = json.dumps({"text_input": PROMPT, "max_tokens": 8, "temperature": 0, "exclude_input_in_output": True,
                       "return_num_output_tokens": True, "return_finish_reason": True}).encode()
    req = urllib.request.Request(f"http://{server.http_url}/v2/models/ouro/generate", data=body,
                                 headers={"Content-Type": "application/json"})
    data = json.loads(urllib.request.urlopen(req, timeout=60).read())
    assert data["text_output"] == ref.text and data["num_output_tokens"] == len(ref.token_ids)
    assert data["finish_reason"] == ref.finish_reason
    assert data["exit_depths"] == ref.exit_depths


def test_stop_words(server, llm):
    ref = offline(llm, PROMPT, max_tokens=30, temperature=0.0)
    # a stop string taken from the middle of the greedy text: the output must end right before it
    text = ref.text
    start = next(i for i in range(6, len(text) - 3) if "\ufffd" not in text[i:i + 3] and text[i:i + 3].strip())
    stop = text[start:start + 3]
    expect = offline(llm, PROMPT, max_tokens=30, temperature=0.0, stop=[stop])
    assert expect.finish_reason == "stop" and stop not in expect.text
    for model in ("ouro", "ouro_ensemble"):
        for stream in (True, False):
            r = generate(server.grpc_url, model, PROMPT, all_flags(max_tokens=30, temperature=0.0, stream=stream,
                                                                  exclude_input_in_output=True, stop_words=[stop]))
            assert r.error is None
            assert r.text == expect.text, (model, stream)
            assert r.finish_reason == "stop"


def test_sampling_with_seed_is_reproducible(server):
    opts = request_options(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=1234)
    a = generate(server.grpc_url, "ouro", PROMPT, opts)
    b = generate(server.grpc_url, "ouro_ensemble", PROMPT, dict(opts, seed=None, random_seed=1234))
    assert a.error is None and b.error is None
    assert a.text == b.text and a.exit_depths == b.exit_depths


# ------------------------------------------------------------------------------------------- concurrency


def test_concurrent_streams(server, llm):
    """16 streams through `ouro` and 8 through the ensemble at once; every stream in order and exact."""
    jobs = [("ouro", PROMPTS[i % len(PROMPTS)]) for i in range(16)] + \
           [("ouro_ensemble", PROMPTS[i % len(PROMPTS)]) for i in range(8)]
    refs = {p: offline(llm, p, max_tokens=24, temperature=0.0) for p in PROMPTS}
    opts = all_flags(max_tokens=24, temperature=0.0)
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda job: generate(server.grpc_url, job[0], job[1], opts, timeout=240), jobs))
    for (model, prompt), r in zip(jobs, results):
        assert r.error is None, (model, r.error)
        assert r.text == refs[prompt].text, (model, prompt)
        assert r.exit_depths == refs[prompt].exit_depths
        assert r.num_tokens == len(refs[prompt].token_ids) and r.finish_reason == refs[prompt].finish_reason
        assert len(r.chunks) > 1


@pytest.mark.parametrize("model", ["ouro", "ouro_ensemble"])
def test_one_grpc_stream_for_many_requests(server, llm, model):
    """The load generator's way: one open stream, request after request. A failed request in between
    (the stream is reopened after it) does not disturb the ones after it."""
    refs = [offline(llm, p, max_tokens=12, temperature=0.0) for p in PROMPTS[:3]]
    opts = all_flags(max_tokens=12, temperature=0.0)
    stream = GrpcStream(server.grpc_url)
    try:
        first = [generate(server.grpc_url, model, p, opts, grpc_stream=stream) for p in PROMPTS[:3]]
        bad = generate(server.grpc_url, model, PROMPT, dict(opts, temperature=-1.0), grpc_stream=stream)
        after = [generate(server.grpc_url, model, p, opts, grpc_stream=stream) for p in PROMPTS[:3]]
    finally:
        stream.close()
    assert bad.error is not None and "temperature must be >= 0" in bad.error
    for r, ref in zip(first + after, refs + refs):
        assert r.error is None, r.error
        assert r.text == ref.text and r.exit_depths == ref.exit_depths and r.finish_reason == ref.finish_reason


def test_load_generator(server):
    """client/load.py's closed loop: every request done, every token counted, no errors."""
    from client.load import run_load

    opts = request_options(max_tokens=8, stream=True, ignore_eos=True, exclude_input_in_output=True,
                           return_num_output_tokens=True)
    for processes in (1, 2):  # workers in this process; spread over two client processes
        report = run_load(server.grpc_url, "ouro", 4, 12, 120.0, opts, PROMPTS, processes=processes)
        assert report["errors"] == 0, report["error_samples"]
        assert report["requests"] == 12 and report["output_tokens"] == 12 * 8
        assert report["unfinished_workers"] == 0 and report["ttft_s"]["p50"] > 0
        assert report["client_processes"] == processes


# ------------------------------------------------------------------------------------------- cancellation


def _generation_stopped(server, before, max_new=MAX_AFTER_CANCEL):
    """KV back to empty, nothing running, one more abort counted as a finished (cancelled) request, and far
    fewer tokens than max_tokens. The metrics of one snapshot reach the server one update at a time (the
    abort counter before the exit-depth observations and the finished count), so a scrape can fall between
    them: wait for all of them."""
    def done():
        m = metrics(server)
        ok = (m.get("ouro_requests_aborted_total", 0) >= before.get("ouro_requests_aborted_total", 0) + 1
              and m.get("ouro_request_success_total", 0) >= before.get("ouro_request_success_total", 0) + 1
              and m.get("ouro_kv_cache_usage_ratio", 1) == 0 and m.get("ouro_num_requests_running", 1) == 0)
        return m if ok else None

    m = wait_for(done, timeout=15)
    assert m, f"engine did not stop/free the cancelled request, or did not count it: {metrics(server)}"
    generated = m["ouro_generation_tokens_total"] - before.get("ouro_generation_tokens_total", 0)
    assert generated < max_new, f"{generated} tokens generated after the cancel"
    return m


def _idle(server):
    wait_for(lambda: metrics(server).get("ouro_num_requests_running", 1) == 0, timeout=30)


def test_cancel_grpc_stop_stream(server):
    import tritonclient.grpc as grpcclient

    _idle(server)
    before = metrics(server)
    client = grpcclient.InferenceServerClient(server.grpc_url)
    q: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    opts = request_options(max_tokens=1500, ignore_eos=True, temperature=0.0)
    client.async_stream_infer("ouro", build_inputs(grpcclient, PROMPT, opts), enable_empty_final_response=True)
    for _ in range(3):
        result, error = q.get(timeout=60)
        assert error is None, error
    mid = metrics(server)
    client.stop_stream(cancel_requests=True)
    client.close()
    _generation_stopped(server, before)
    assert mid.get("ouro_generation_tokens_total", 0) < before.get("ouro_generation_tokens_total", 0) + 1500


def test_cancel_http_disconnect(server):
    import http.client

    _idle(server)
    before = metrics(server)
    host, port = server.http_url.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = {"text_input": PROMPT, "max_tokens": 1500, "ignore_eos": True, "stream": True, "temperature": 0}
    conn.request("POST", "/v2/models/ouro/generate_stream", body=json.dumps(body))
    resp = conn.getresponse()
    events = 0
    while events < 3:
        line = resp.readline()
        assert line, "stream ended early"
        events += line.startswith(b"data:")
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    _generation_stopped(server, before)


def test_server_healthy_after_cancellations(server, llm):
    ref = offline(llm, PROMPT, max_tokens=6, temperature=0.0)
    r = generate(server.grpc_url, "ouro", PROMPT, request_options(max_tokens=6, temperature=0.0))
    assert r.error is None and r.text == ref.text


# ------------------------------------------------------------------------------------------- bad requests


BAD_REQUESTS = [
    ("missing text_input", None, {"max_tokens": 4}, "missing required input 'text_input'"),
    ("empty text", "", {"max_tokens": 4}, "text_input is empty"),
    ("negative max_tokens", PROMPT, {"max_tokens": -5}, "max_tokens must be a positive integer, got -5"),
    ("max_tokens beyond context", PROMPT, {"max_tokens": 100000}, "exceeds the context limit"),
    ("min_loops > max_loops", PROMPT, {"min_loops": 3, "max_loops": 2}, r"min_loops \(3\) must not exceed max_loops \(2\)"),
    ("max_loops > model loops", PROMPT, {"max_loops": 9}, r"max_loops \(9\) exceeds the model's 4 loops"),
    ("exit_threshold 1.5", PROMPT, {"exit_threshold": 1.5}, r"exit_threshold must be in \[0, 1\], got 1.5"),
    ("temperature < 0", PROMPT, {"temperature": -1.0}, "temperature must be >= 0"),
]


def _grpc_error(server, model, prompt, opts, raw_inputs=None):
    import tritonclient.grpc as grpcclient

    inputs = raw_inputs
    if inputs is None:
        inputs = build_inputs(grpcclient, prompt or "", opts)
        if prompt is None:
            inputs = inputs[1:]
    client = grpcclient.InferenceServerClient(server.grpc_url)
    q: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    try:
        client.async_stream_infer(model, inputs, enable_empty_final_response=True)
        while True:
            result, error = q.get(timeout=60)
            if error is not None:
                return str(error)
            if result.get_response().parameters["triton_final_response"].bool_param:
                return None
    finally:
        client.stop_stream()
        client.close()


@pytest.mark.parametrize("model", ["ouro", "ouro_ensemble"])
@pytest.mark.parametrize("case, prompt, opts, match", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_requests_grpc(server, model, case, prompt, opts, match):
    error = _grpc_error(server, model, prompt, opts)
    assert error is not None, f"{case}: no error"
    assert re.search(match, error), error


def test_bad_request_types_and_unknown_inputs(server):
    import tritonclient.grpc as grpcclient

    def tensor(name, arr, dt):
        t = grpcclient.InferInput(name, list(arr.shape), dt)
        t.set_data_from_numpy(arr)
        return t

    text = tensor("text_input", np.array([[PROMPT.encode()]], dtype=np.object_), "BYTES")
    for model in ("ouro", "ouro_ensemble", "ouro_engine"):
        first = text if model != "ouro_engine" else tensor("input_ids", np.array([[5, 6]], np.int32), "INT32")
        err = _grpc_error(server, model, None, None, [first, tensor("max_tokens", np.array([[4.0]], np.float32), "FP32")])
        assert err and re.search(r"max_tokens.*FP32.*INT64", err), err  # Triton's own type check
        err = _grpc_error(server, model, None, None, [first, tensor("frobnicate", np.array([[1]], np.int32), "INT32")])
        assert err and "frobnicate" in err, err
    err = _grpc_error(server, "ouro_engine", None, None,
                      [tensor("input_ids", np.array([[5, 99999]], np.int32), "INT32")])
    assert err and "outside the vocabulary" in err, err


@pytest.mark.parametrize("model", ["ouro", "ouro_ensemble"])
def test_bad_requests_http(server, model):
    cases = [({"text_input": PROMPT, "max_tokens": 4, "max_new_tokens": 3}, "unknown field.*'max_new_tokens'"),
             ({"text_input": PROMPT, "max_tokens": "four"}, "Unable to parse"),  # Triton's JSON parser
             ({"text_input": "", "max_tokens": 4}, "text_input is empty"),
             ({"text_input": PROMPT, "exit_threshold": 1.5}, r"exit_threshold must be in \[0, 1\]")]
    for body, match in cases:
        for endpoint in ("generate", "generate_stream"):
            req = urllib.request.Request(f"http://{server.http_url}/v2/models/{model}/{endpoint}",
                                         data=json.dumps(dict(body, stream=endpoint == "generate_stream")).encode(),
                                         headers={"Content-Type": "application/json"})
            try:
                text = urllib.request.urlopen(req, timeout=60).read().decode()
            except urllib.error.HTTPError as e:
                text = e.read().decode()
            assert re.search(match, text), (endpoint, body, text)
    # and the server keeps serving
    r = generate(server.http_url, model, PROMPT, request_options(max_tokens=3, temperature=0.0), protocol="http")
    assert r.error is None and r.num_tokens == 3


# ------------------------------------------------------------------------------------------- metrics, perf


def test_metrics(server):
    # A request of its own that exits at mixed depths (see test_grpc_streaming_matches_offline).
    r = generate(server.grpc_url, "ouro", PROMPT, all_flags(max_tokens=24, temperature=0.0, exit_threshold=0.7))
    assert r.error is None and min(r.exit_depths) < 4
    # Published within about 2 x metrics_interval_s (engine process -> ouro_engine -> server).
    m = wait_for(lambda: (lambda m: m if m.get("ouro_request_success_total") and m.get("ouro_exit_depth_bucket{3}")
                          else None)(metrics(server)))
    assert m, metrics(server)
    for name in ("ouro_prompt_tokens_total", "ouro_generation_tokens_total", "ouro_requests_aborted_total",
                 "ouro_kv_cache_usage_ratio", "ouro_num_requests_running", "ouro_num_requests_waiting",
                 "ouro_num_requests_swapped", "ouro_num_preemptions_total",
                 "ouro_time_to_first_token_seconds_count", "ouro_time_per_output_token_seconds_count",
                 "ouro_e2e_request_latency_seconds_count", "ouro_exit_depth_count", "ouro_request_success_total"):
        assert name in m, f"{name} missing from {sorted(m)}"
    assert m["ouro_generation_tokens_total"] > 0 and m["ouro_exit_depth_count"] > 0
    assert m["ouro_time_to_first_token_seconds_count"] > 0
    # exit depths are integers 1..4: the le="1" .. le="4" buckets hold them all, some below depth 4
    assert m["ouro_exit_depth_bucket{4}"] == m["ouro_exit_depth_count"]
    assert m["ouro_exit_depth_bucket{3}"] > 0


def test_error_metric_counts_errors_of_every_model(server):
    """ouro_request_errors_total counts the front's own refusals, ouro_engine's and the engine's."""
    import tritonclient.grpc as grpcclient

    before = metrics(server).get("ouro_request_errors_total", 0)
    assert "max_tokens" in _grpc_error(server, "ouro", PROMPT, request_options(max_tokens=0))  # the front
    assert "context limit" in _grpc_error(server, "ouro", PROMPT, request_options(max_tokens=100000))  # engine
    ids = grpcclient.InferInput("input_ids", [1, 2], "INT32")
    ids.set_data_from_numpy(np.array([[5, 6]], np.int32))
    top_k = grpcclient.InferInput("top_k", [1, 1], "INT64")
    top_k.set_data_from_numpy(np.array([[-5]], np.int64))
    assert "top_k" in _grpc_error(server, "ouro_engine", None, None, raw_inputs=[ids, top_k])  # ouro_engine
    assert wait_for(lambda: metrics(server).get("ouro_request_errors_total", 0) >= before + 3), metrics(server)


def test_perf_analyzer(server, tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "client", "perf_analyzer"))
    from locate import PerfAnalyzerUnavailable  # noqa: E402
    from run_perf import run  # noqa: E402

    try:
        report = run(server.grpc_url, models=("ouro", "ouro_ensemble"), concurrency=(2,), max_tokens=8,
                     measurement_ms=1000, max_trials=3, timeout=120, out_dir=str(tmp_path), exit_threshold=1.0,
                     prompts=[PROMPT])
    except PerfAnalyzerUnavailable as e:
        pytest.skip(f"perf_analyzer cannot run here: {e}")
    for r in report["runs"]:
        assert r["ok"], json.dumps(r, indent=1)
        assert r["response_throughput_per_s"] > r["throughput_infer_per_s"] > 0  # several responses per request
    data = json.loads((tmp_path / "input_data.json").read_text())["data"]
    assert {e["text_input"][0] for e in data} == {PROMPT} and all(e["exit_threshold"] == [1.0] for e in data)


# ------------------------------------------------------------------------------------------- load failures


def test_engine_process_death_ends_requests_with_errors(toy_path, llm):
    """If the engine process dies, open requests end with an error (none hangs), the server keeps serving,
    a new engine process takes over (the front reconnects) and shutdown is clean."""
    import signal

    srv = _server_or_skip(model=toy_path, engine_args=ENGINE_ARGS, address="127.0.0.1")  # this host only
    srv.start(timeout=300)
    try:
        pid = int(re.search(r"engine 0 ready on \S+ \(process (\d+)\)", srv.log_text()).group(1))
        opts = request_options(max_tokens=1500, ignore_eos=True, temperature=0.0, stream=True)
        models = ("ouro", "ouro_ensemble")
        started = {m: threading.Event() for m in models}
        results = {}

        def run(model):
            results[model] = generate(srv.grpc_url, model, PROMPT, opts, timeout=60,
                                      on_chunk=lambda c: started[model].set())

        threads = [threading.Thread(target=run, args=(m,)) for m in models]
        for t in threads:
            t.start()
        for m in models:
            assert started[m].wait(timeout=60), f"{m} did not start streaming"
        os.kill(pid, signal.SIGKILL)
        for t in threads:
            t.join(timeout=60)
        for model in models:
            assert "the engine process exited" in (results[model].error or ""), (model, results[model].error)
        assert urllib.request.urlopen(f"http://{srv.http_url}/v2/health/live", timeout=10).status == 200
        ref = offline(llm, PROMPT, max_tokens=8, temperature=0.0)
        short = request_options(max_tokens=8, temperature=0.0, stream=True)

        def served_again():
            r = generate(srv.grpc_url, "ouro", PROMPT, short, timeout=60)
            assert r.end - r.start < 10, "a request refused while the engine restarts does not wait"
            return r.error is None and r

        again = wait_for(served_again, timeout=120, interval=0.5)
        assert again and again.text == ref.text
        new_pid = int(re.findall(r"engine process (\d+) ready", srv.log_text())[-1])
        assert new_pid != pid
    finally:
        code = srv.stop()
    assert code == 0, srv.log_tail()



def test_request_trace_times_every_hop(toy_path, llm, tmp_path):
    """OURO_REQUEST_TRACE: each streamed request is seen at every hop (client, front, engine process, front,
    client), in order, joined through the request id the client sent."""
    from ouro_backend.serving import request_trace

    trace_dir = tmp_path / "hops"
    srv = _server_or_skip(model=toy_path, engine_args=ENGINE_ARGS, address="127.0.0.1",
                          env={request_trace.ENV: str(trace_dir)})
    srv.start(timeout=300)
    client_trace = request_trace.RequestTrace(str(trace_dir), "client")
    try:
        opts = request_options(max_tokens=8, temperature=0.0, stream=True)

        def one(prompt):
            stream = GrpcStream(srv.grpc_url, trace=client_trace)
            try:
                return generate(srv.grpc_url, "ouro", prompt, opts, timeout=60, grpc_stream=stream)
            finally:
                stream.close()

        with ThreadPoolExecutor(4) as ex:
            got = list(ex.map(one, PROMPTS[:4]))
        assert [r.error for r in got] == [None] * 4
    finally:
        code = srv.stop()
    assert code == 0, srv.log_tail()
    client_trace.write()
    summary = request_trace.summarize(str(trace_dir))
    assert summary["requests"] == 4, (summary, sorted(os.listdir(trace_dir)))
    hops = {k: v for k, v in summary.items() if " -> " in k}
    assert len(hops) == len(request_trace.HOPS) - 1
    # The events come in the documented order; the client may have a response before the front's send()
    # returns, so the last hop alone can be negative.
    assert all(v["median_ms"] >= 0 for k, v in hops.items() if k != "front.responded -> client.received"), hops
    assert summary["ttft_ms"]["median_ms"] > 0


def engine_tokens(server) -> dict[str, float]:
    """ouro_generation_tokens_total of each engine process (label `engine`)."""
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    out: dict[str, float] = {}
    for labels, value in re.findall(r"^ouro_generation_tokens_total\{([^}]*)\} (\S+)$", text, re.M):
        engine = re.search(r'engine="(\d+)"', labels).group(1)
        out[engine] = out.get(engine, 0.0) + float(value)
    return out


def test_every_device_serves_and_a_killed_engine_comes_back(toy_path, llm):
    """engine_devices=cpu,cpu (what `auto` makes of two GPUs, here on the CPU): requests through both models
    spread over the two engine processes with the offline engine's text, each engine has its own metrics
    series, and a killed engine leaves the other serving and is back within a minute."""
    import signal

    srv = _server_or_skip(model=toy_path, engine_args=ENGINE_ARGS, address="127.0.0.1",
                          devices=f"{DEVICE},{DEVICE}" if DEVICE == "cpu" else "cuda:0,cuda:0")
    srv.start(timeout=300)
    try:
        pids = {int(i): int(p) for i, p in re.findall(r"engine (\d) ready on \S+ \(process (\d+)\)", srv.log_text())}
        assert sorted(pids) == [0, 1], srv.log_tail()
        opts = request_options(max_tokens=16, temperature=0.0, stream=True)
        ref = {p: offline(llm, p, max_tokens=16, temperature=0.0).text for p in PROMPTS}
        work = [(m, p) for m in ("ouro", "ouro_ensemble") for p in PROMPTS]

        def serve_all():
            with ThreadPoolExecutor(8) as ex:
                got = list(ex.map(lambda mp: generate(srv.grpc_url, mp[0], mp[1], opts, timeout=60), work))
            assert [(r.error, r.text) for r in got] == [(None, ref[p]) for _, p in work]

        serve_all()
        assert wait_for(lambda: (c := engine_tokens(srv)) and c.get("0", 0) > 0 and c.get("1", 0) > 0), \
            f"both engines take requests: {engine_tokens(srv)}"

        os.kill(pids[1], signal.SIGKILL)
        assert wait_for(lambda: "engine 1 (" in srv.log_text() and "exited with code" in srv.log_text(), timeout=30)
        serve_all()  # the other engine serves on (and engine 1 once it is back)
        back = wait_for(lambda: re.findall(r"engine 1 \(\S+\): engine process (\d+) ready", srv.log_text()),
                        timeout=60)
        assert back and int(back[-1]) != pids[1], "engine 1 was not restarted within a minute"
        before = engine_tokens(srv).get("1", 0)
        time.sleep(1.0)  # the front retries a lost engine at most once a second
        serve_all()
        assert wait_for(lambda: engine_tokens(srv).get("1", 0) > before), "the restarted engine gets requests again"
    finally:
        code = srv.stop()
    assert code == 0, srv.log_tail()
    assert "Traceback" not in srv.log_text()


@pytest.mark.parametrize("model, message", [
    ("ouro_engine", "ouro_engine: invalid engine configuration: unknown engine option 'bogus_option'"),
    ("ouro", "ouro: unknown parameter 'bogus_option'"),
])
def test_bad_option_fails_model_load(tmp_path, model, message):
    """A bad `parameters` entry in a model's config.pbtxt fails its load with a readable message."""
    repo = tmp_path / "repo"
    (repo / model / "1").mkdir(parents=True)
    os.symlink(os.path.join(ROOT, "model_repository", model, "1", "model.py"), repo / model / "1" / "model.py")
    config = open(os.path.join(ROOT, "model_repository", model, "config.pbtxt")).read()
    config += 'parameters { key: "bogus_option" value: { string_value: "1" } }\n'
    (repo / model / "config.pbtxt").write_text(config)
    srv = _server_or_skip(model_repository=str(repo))
    try:
        with pytest.raises(ServerError, match="exited"):
            srv.start(timeout=120)
    finally:
        srv.stop()
    log = srv.log_text()
    assert f"failed to load '{model}'" in log
    assert message in log, srv.log_tail()


def test_launcher_rejects_bad_engine_arg():
    r = subprocess.run([sys.executable, "-m", "ouro_backend.entrypoints.serve", "--engine-arg", "max_num_seqs=-1",
                        "--http-port", "1"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "bad --engine-arg: max_num_seqs must be a positive integer" in r.stderr, r.stderr


def test_launcher_rejects_bad_devices():
    r = subprocess.run([sys.executable, "-m", "ouro_backend.entrypoints.serve", "--devices", "cuda:7",
                        "--engine-arg", "device=cpu", "--http-port", "1"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, CUDA_VISIBLE_DEVICES="0"))
    assert r.returncode == 2 and "bad --devices: engine_devices='cuda:7': cuda:7 is not visible (1 GPU(s) visible)" \
        in r.stderr, r.stderr


def test_grafana_dashboard_queries_exist_on_metrics_port(server):
    """Every metric that deploy/grafana/ouro-dashboard.json queries (panel `expr`s and the templating
    variables' label_values queries) is exposed on the metrics port of the real server, and so is every
    `stat` label value of ouro_engine_stat it uses."""
    with open(os.path.join(ROOT, "deploy", "grafana", "ouro-dashboard.json")) as f:
        dash = json.load(f)
    keywords = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool",
                "offset", "inf", "nan"}

    def metric_names(expr: str) -> set[str]:
        e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # label values, quantile strings
        e = re.sub(r"\{[^}]*\}", " ", e)  # label matchers
        e = re.sub(r"\[[^\]]*\]", " ", e)  # ranges and subqueries ([$__rate_interval], [5m:1m])
        e = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)  # label lists
        e = re.sub(r"\boffset\s+-?\w+", " ", e)
        e = re.sub(r"\$\{?\w+\}?", " ", e)  # Grafana variables
        e = re.sub(r"(?<![\w:])(?:0x[0-9a-fA-F]+|\d+(?:\.\d*)?(?:[eE][+-]?\d+)?)", " ", e)  # numbers
        names = re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*(?!\s*\(|[a-zA-Z0-9_:])", e)  # not functions
        return {n for n in names if n.lower() not in keywords}

    def stat_values(expr: str) -> set[str]:
        out: set[str] = set()
        for matchers in re.findall(r"\bouro_engine_stat\s*\{([^}]*)\}", expr):
            for op, value in re.findall(r'\bstat\s*(=~|=)\s*"([^"]*)"', matchers):
                assert op == "=" or re.fullmatch(r"[\w|]+", value), f"stat=~ regex not a plain alternation: {value}"
                out.update(value.split("|"))
        return out

    def panels(items):
        for p in items:
            yield p
            yield from panels(p.get("panels", []))

    used: dict[str, set[str]] = {}  # metric name -> where the dashboard uses it
    stats: dict[str, set[str]] = {}
    exprs = [(f"panel {p['id']} {p['title']!r}", t["expr"]) for p in panels(dash["panels"])
             for t in p.get("targets", []) if t.get("expr")]
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"] if isinstance(var["query"], str) else var["query"]["query"]
            m = re.fullmatch(r"\s*label_values\((.+),\s*\w+\)\s*", query)
            assert m, f"variable {var['name']}: not a label_values(metric, label) query: {query}"
            exprs.append((f"variable ${var['name']}", m.group(1)))
    assert len(exprs) > 20, "the dashboard should have its panels' queries"
    for where, expr in exprs:
        names = metric_names(expr)
        assert names, f"{where}: no metric name found in {expr!r}"
        assert all(re.match(r"(ouro|nv)_", n) for n in names), f"{where}: odd identifiers {names} in {expr!r}"
        for n in names:
            used.setdefault(n, set()).add(where)
        for s in stat_values(expr):
            stats.setdefault(s, set()).add(where)
        if "histogram_quantile" in expr:
            assert re.search(r"_bucket\b", expr), f"{where}: histogram_quantile over no _bucket series: {expr!r}"
    assert "ouro_engine_stat" in used and {"rounds", "host_syncs"} <= set(stats), (sorted(used), sorted(stats))

    # Requests first, so the histograms' and finish reasons' series exist: one through the front (mixed exit
    # depths), one through the ensemble (nv_inference_* of every model).
    r = generate(server.grpc_url, "ouro", PROMPT, all_flags(max_tokens=8, temperature=0.0, exit_threshold=0.7))
    assert r.error is None
    r = generate(server.http_url, "ouro_ensemble", PROMPT, request_options(max_tokens=4, temperature=0.0),
                 protocol="http")
    assert r.error is None

    def scrape():
        text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
        samples = re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+\S+", text, re.M)
        types = dict(re.findall(r"^# TYPE (\S+) (\S+)", text, re.M))
        exposed = {name for name, _ in samples}
        have_stats = {m.group(1) for name, labels in samples if name == "ouro_engine_stat"
                      for m in [re.search(r'stat="([^"]*)"', labels)] if m}
        missing = {n: sorted(w) for n, w in used.items() if n not in exposed}
        missing_stats = {s: sorted(w) for s, w in stats.items() if s not in have_stats}
        return missing, missing_stats, types

    # Published within about 2 x metrics_interval_s (engine process -> ouro_engine -> server).
    wait_for(lambda: scrape()[:2] == ({}, {}), timeout=15)
    missing, missing_stats, types = scrape()
    problems = [f"metric {n} (used by {', '.join(w)})" for n, w in sorted(missing.items())]
    problems += [f'ouro_engine_stat{{stat="{s}"}} (used by {", ".join(w)})' for s, w in sorted(missing_stats.items())]
    assert not problems, (f"queried by deploy/grafana/ouro-dashboard.json but not exposed on {server.metrics_url}:\n  "
                          + "\n  ".join(problems))
    # Suffixed series belong to a histogram family; plain names are counters or gauges, never a histogram.
    for n in used:
        base = re.sub(r"_(bucket|sum|count)$", "", n)
        if base != n and base in types:
            assert types[base] == "histogram", f"{n}: {base} is a {types[base]}, not a histogram"
        else:
            assert types.get(n) in ("counter", "gauge"), f"{n}: type {types.get(n)}"
