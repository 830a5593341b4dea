"""Cancellation through a real tritonserver: gRPC stop_stream, an HTTP disconnect, and a server that stays
healthy after many.

The shared server is conftest.py's session fixture `server`; the helpers are in server_common.py."""

from __future__ import annotations

import json
import queue
import socket

import pytest
from helpers import wait_for
from server_common import MAX_AFTER_CANCEL, PROMPT, metrics, offline

from client.ouro_client import build_inputs, generate, request_options

pytestmark = pytest.mark.timeout(300)


# ------------------------------------------------------------------------------------------- cancellation


def _generation_stopped(server, before, max_new=MAX_AFTER_CANCEL):
    """KV back to empty, nothing running, one more abort counted as a finished (cancelled) request, and far
    fewer tokens than max_tokens. The metrics of one snapshot reach the server one update at a time (the
    abort counter before the exit-depth observations and the finished count), so a scrape can fall between
    them: wait for all of them."""

    def done():
        m = metrics(server)
        ok = (
            m.get("ouro_requests_aborted_total", 0) >= before.get("ouro_requests_aborted_total", 0) + 1
            and m.get("ouro_request_success_total", 0) >= before.get("ouro_request_success_total", 0) + 1
            and m.get("ouro_kv_cache_usage_ratio", 1) == 0
            and m.get("ouro_num_requests_running", 1) == 0
        )
        return m if ok else None

    m = wait_for(done, timeout=15)
    assert m, f"engine did not stop/free the cancelled request, or did not count it: {metrics(server)}"
    generated = m["ouro_generation_tokens_total"] - before.get("ouro_generation_tokens_total", 0)
    assert generated < max_new, f"{generated} tokens generated after the cancel"
    return m


def _idle(server):
    wait_for(lambda: metrics(server).get("ouro_num_requests_running", 1) == 0, timeout=30)


@pytest.mark.parametrize("interval", [None, 4])  # 4: cancelled while tokens short of an interval wait
def test_cancel_grpc_stop_stream(server, interval):
    import tritonclient.grpc as grpcclient

    _idle(server)
    before = metrics(server)
    client = grpcclient.InferenceServerClient(server.grpc_url)
    q: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    opts = request_options(max_tokens=1500, ignore_eos=True, temperature=0.0, stream_interval=interval)
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
