"""Bad requests through a real tritonserver: each gets an error naming the problem (gRPC and HTTP, every
model), the server serves on, and the error metric counts them.

The shared server is conftest.py's session fixture `server`; the helpers are in server_common.py."""

from __future__ import annotations

import json
import queue
import re
import urllib.request

import numpy as np
import pytest
from helpers import wait_for
from server_common import PROMPT, metrics

from client.ouro_client import build_inputs, generate, request_options
from ouro_backend.entrypoints.tritonserver import ServerError

pytestmark = pytest.mark.timeout(300)


# ------------------------------------------------------------------------------------------- bad requests


BAD_REQUESTS = [
    ("missing text_input", None, {"max_tokens": 4}, "missing required input 'text_input'"),
    ("empty text", "", {"max_tokens": 4}, "text_input is empty"),
    ("negative max_tokens", PROMPT, {"max_tokens": -5}, "max_tokens must be a positive integer, got -5"),
    ("max_tokens beyond context", PROMPT, {"max_tokens": 100000}, "exceeds the context limit"),
    (
        "min_loops > max_loops",
        PROMPT,
        {"min_loops": 3, "max_loops": 2},
        r"min_loops \(3\) must not exceed max_loops \(2\)",
    ),
    ("max_loops > model loops", PROMPT, {"max_loops": 9}, r"max_loops \(9\) exceeds the model's 4 loops"),
    ("exit_threshold 1.5", PROMPT, {"exit_threshold": 1.5}, r"exit_threshold must be in \[0, 1\], got 1.5"),
    ("temperature < 0", PROMPT, {"temperature": -1.0}, "temperature must be >= 0"),
]


def grpc_error(server, model, prompt, opts, raw_inputs=None):
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
    error = grpc_error(server, model, prompt, opts)
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
        err = grpc_error(
            server, model, None, None, [first, tensor("max_tokens", np.array([[4.0]], np.float32), "FP32")]
        )
        assert err and re.search(r"max_tokens.*FP32.*INT64", err), err  # Triton's own type check
        err = grpc_error(server, model, None, None, [first, tensor("frobnicate", np.array([[1]], np.int32), "INT32")])
        assert err and "frobnicate" in err, err
    err = grpc_error(
        server, "ouro_engine", None, None, [tensor("input_ids", np.array([[5, 99999]], np.int32), "INT32")]
    )
    assert err and "outside the vocabulary" in err, err


@pytest.mark.parametrize("model", ["ouro", "ouro_ensemble"])
def test_bad_requests_http(server, model):
    cases = [
        ({"text_input": PROMPT, "max_tokens": 4, "max_new_tokens": 3}, "unknown field.*'max_new_tokens'"),
        ({"text_input": PROMPT, "max_tokens": "four"}, "Unable to parse"),  # Triton's JSON parser
        ({"text_input": "", "max_tokens": 4}, "text_input is empty"),
        ({"text_input": PROMPT, "exit_threshold": 1.5}, r"exit_threshold must be in \[0, 1\]"),
    ]
    for body, match in cases:
        for endpoint in ("generate", "generate_stream"):
            req = urllib.request.Request(
                f"http://{server.http_url}/v2/models/{model}/{endpoint}",
                data=json.dumps(dict(body, stream=endpoint == "generate_stream")).encode(),
                headers={"Content-Type": "application/json"},
            )
            try:
                text = urllib.request.urlopen(req, timeout=60).read().decode()
            except urllib.error.HTTPError as e:
                text = e.read().decode()
            assert re.search(match, text), (endpoint, body, text)
    # and the server keeps serving
    r = generate(server.http_url, model, PROMPT, request_options(max_tokens=3, temperature=0.0), protocol="http")
    assert r.error is None and r.num_tokens == 3


def test_error_metric_counts_errors_of_every_model(server):
    """ouro_request_errors_total counts the front's own refusals, ouro_engine's and the engine's."""
    import tritonclient.grpc as grpcclient

    before = metrics(server).get("ouro_request_errors_total", 0)
    assert "max_tokens" in grpc_error(server, "ouro", PROMPT, request_options(max_tokens=0))  # the front
    assert "context limit" in grpc_error(server, "ouro", PROMPT, request_options(max_tokens=100000))  # engine
    ids = grpcclient.InferInput("input_ids", [1, 2], "INT32")
    ids.set_data_from_numpy(np.array([[5, 6]], np.int32))
    top_k = grpcclient.InferInput("top_k", [1, 1], "INT64")
    top_k.set_data_from_numpy(np.array([[-5]], np.int64))
    assert "top_k" in grpc_error(server, "ouro_engine", None, None, raw_inputs=[ids, top_k])  # ouro_engine
    assert wait_for(lambda: metrics(server).get("ouro_request_errors_total", 0) >= before + 3), metrics(server)


def test_a_start_that_is_not_ready_names_each_models_state(server, monkeypatch):
    """When a start times out, the error says where each model is (the repository index), not only the log:
    a start that hangs then names the model that holds it. Here on the running server, readiness forced
    false."""
    monkeypatch.setattr(server, "is_ready", lambda: False)
    with pytest.raises(ServerError, match=r"not ready after 1s \(models: .*ouro READY, ouro_engine READY"):
        server.wait_ready(timeout=1)
    assert {"ouro", "ouro_engine", "preprocessing", "postprocessing"} <= set(server.model_states())
