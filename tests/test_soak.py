"""Soak: the real server (`ouro-serve`, toy model, a small KV cache) under churn.

300 requests (OURO_SOAK_REQUESTS; 1,000 for a longer soak) from 32 concurrent clients: max_tokens from 1 to
4,096, prompts with and without a long shared prefix (prefix caching on), stop strings, gRPC streaming and HTTP
SSE, and 30% cancelled at a random point (gRPC stream cancel or HTTP disconnect). The cache holds far less than
32 requests' worth, so requests are preempted and resumed all along. Afterwards: every uncancelled request's
text equals its text on the quiet server, nothing is stuck, every KV block is free, nothing is swapped, and the
engine process never restarted.

The toy decodes about 50 tokens/s alone and a few hundred under this load on 2 CPU cores, so to stay within
minutes the lengths are mostly short: max_tokens 4,096 is drawn for 5% of the requests, and those are always
cancelled (after 20-200 responses); they grow for hundreds of tokens and get preempted like any other. 300
requests keep CI within its time; the test asserts that preemptions, aborts and prefix hits all happened
(and prints their counts), and more requests add churn time, not paths.
"""

from __future__ import annotations

import http.client
import json
import os
import queue
import random
import shutil
import socket
import threading
import time

import pytest
from helpers import wait_for
from server_common import metrics, server_or_skip

from client.ouro_client import build_inputs, generate, request_options

# Alone on 2 cores it takes about 1-2 minutes (1,000 requests: 2-4); a shared machine has been seen to take 4x
# that. The limit only ends a hung run: the test checks every request's outcome, not its speed.
pytestmark = pytest.mark.timeout(2400)

NUM_REQUESTS = int(os.environ.get("OURO_SOAK_REQUESTS", "300"))
CLIENTS = 32
CANCEL_SHARE = 0.3
SHARED_PREFIX = (
    "You are a careful assistant. Answer briefly and truthfully, cite nothing, and stop when the "
    "question is answered. Here is the question of the day, the background and the constraints. "
) * 3
QUESTIONS = [
    "Why is the sky blue?",
    "What is a loop?",
    "Name a prime.",
    "How far is the moon?",
    "Who wrote it?",
    "Is it raining?",
]
MAX_TOKENS = [1, 3, 9, 27, 81, 243]  # log-spaced; 4,096 is drawn apart (LONG_SHARE), always cancelled
# NOTE the long requests are what make the cache short (the test asserts a preemption): a few at once, each
# cancelled only after 100-300 responses, hold enough blocks that the running requests cannot all grow.
LONG_MAX_TOKENS, LONG_SHARE = 4096, 0.08
STOPS = [None, ["th"], ["a", "qz"]]


@pytest.fixture(scope="module")
def soak_model(toy_path, tmp_path_factory) -> str:
    """The toy with an 8K context (the same weights; RoPE does not depend on the limit), so max_tokens can
    reach 4,096."""
    path = tmp_path_factory.mktemp("soak") / "toy-8k"
    shutil.copytree(toy_path, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["max_position_embeddings"] = 8192
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return str(path)


def prompt_of(i: int) -> str:
    """Even questions after the shared prefix; odd ones after a preamble of their own, as long (no sharing)."""
    q = QUESTIONS[i % len(QUESTIONS)]
    return SHARED_PREFIX + q if i % 2 == 0 else (q + " ") * 30 + q


def request_specs() -> list[dict]:
    """The distinct requests the clients draw from: shared-prefix and plain prompts x lengths x stops."""
    specs = []
    for i in range(len(QUESTIONS)):
        prompt = prompt_of(i)
        for j, n in enumerate(MAX_TOKENS):
            specs.append(dict(prompt=prompt, max_tokens=n, stop=STOPS[(i + j) % len(STOPS)]))
    return specs


def long_spec(i: int) -> dict:
    return dict(prompt=prompt_of(i), max_tokens=LONG_MAX_TOKENS, stop=None)


def options(spec: dict) -> dict:
    return request_options(max_tokens=spec["max_tokens"], temperature=0.0, stop_words=spec["stop"])


def cancel_grpc(url: str, spec: dict, after: int) -> None:
    """Stream over gRPC and cancel after `after` responses. A request that ended first is not cancelled:
    cancelling a finished request over its stream leaves tritonserver 2.51 unable to unload `ouro` at
    shutdown (it waits out its 30 s exit timeout), a Triton behaviour this test does not cover."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    q: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    client.async_stream_infer(
        "ouro", build_inputs(grpcclient, spec["prompt"], options(spec)), enable_empty_final_response=True
    )
    finished = False
    for _ in range(after):
        result, error = q.get(timeout=120)
        if error is not None or result.get_response().parameters["triton_final_response"].bool_param:
            finished = True
            break
    client.stop_stream(cancel_requests=not finished)
    client.close()


def cancel_http(url: str, spec: dict, after: int) -> None:
    """Stream over HTTP SSE and drop the connection after `after` events."""
    host, port = url.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    body = {"text_input": spec["prompt"], "max_tokens": spec["max_tokens"], "stream": True, "temperature": 0}
    if spec["stop"]:
        body["stop_words"] = spec["stop"]
    conn.request("POST", "/v2/models/ouro/generate_stream", body=json.dumps(body))
    resp = conn.getresponse()
    events = 0
    while events < after:
        line = resp.readline()
        if not line:
            break
        events += line.startswith(b"data:")
    try:
        conn.sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    conn.close()


def test_soak_churn_preemption_and_cancellation(soak_model):
    # 1,100 blocks of 16: one 4,096-token request fits alone (4 planes x 263 blocks), 32 requests of a few
    # hundred tokens do not.
    # Prefix caching on: the shared-prefix prompts hit it, under preemption and cancellation.
    engine_args = dict(
        device="cpu", dtype="float32", num_blocks=1100, max_num_seqs=CLIENTS, enable_prefix_caching="true"
    )
    srv = server_or_skip(model=soak_model, engine_args=engine_args, address="127.0.0.1")
    specs = request_specs()
    try:
        srv.start(timeout=300)
        # The quiet server: each distinct request alone.
        quiet = []
        for spec in specs:
            r = generate(srv.grpc_url, "ouro", spec["prompt"], options(spec))
            assert r.error is None, r.error
            quiet.append(r.text)
        rng = random.Random(0)
        plan = []  # (spec, cancel?, over gRPC?, cancel after this many responses)
        for i in range(NUM_REQUESTS):
            if rng.random() < LONG_SHARE:
                plan.append((long_spec(i), True, rng.random() < 0.5, rng.randint(100, 300)))
            else:
                k = rng.randrange(len(specs))
                plan.append((k, rng.random() < CANCEL_SHARE, rng.random() < 0.5, rng.randint(1, 40)))
        results: dict[int, object] = {}
        errors: list[str] = []
        next_i = [0]
        lock = threading.Lock()

        def worker() -> None:
            while True:
                with lock:
                    i = next_i[0]
                    if i >= len(plan):
                        return
                    next_i[0] += 1
                k, cancel, grpc_side, after = plan[i]
                spec = k if isinstance(k, dict) else specs[k]
                try:
                    if cancel:
                        (cancel_grpc if grpc_side else cancel_http)(
                            srv.grpc_url if grpc_side else srv.http_url, spec, after
                        )
                    else:
                        r = generate(
                            srv.grpc_url if grpc_side else srv.http_url,
                            "ouro",
                            spec["prompt"],
                            options(spec),
                            protocol="grpc" if grpc_side else "http",
                            timeout=300,
                        )
                        results[i] = r
                except Exception as e:
                    errors.append(f"request {i}: {type(e).__name__}: {e}")

        t0 = time.monotonic()
        threads = [threading.Thread(target=worker, daemon=True) for _ in range(CLIENTS)]
        for t in threads:
            t.start()
        deadline = t0 + 2000  # one limit for all clients together (see pytestmark)
        for t in threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        elapsed = time.monotonic() - t0
        assert not any(t.is_alive() for t in threads), "stuck requests: clients still waiting"
        assert not errors, errors[:5]

        mismatched = [(i, plan[i][0]) for i, r in results.items() if r.error or r.text != quiet[plan[i][0]]]
        assert not mismatched, f"{len(mismatched)} texts differ from the quiet server's, e.g. {mismatched[:5]}"

        # Everything drains: no request left anywhere, every block free.
        def drained():
            m = metrics(srv)
            ok = (
                m.get("ouro_num_requests_running", 1) == 0
                and m.get("ouro_num_requests_waiting", 1) == 0
                and m.get("ouro_num_requests_swapped", 1) == 0
                and m.get("ouro_kv_cache_usage_ratio", 1) == 0
            )
            return m if ok else None

        m = wait_for(drained, timeout=60)
        assert m, f"not drained: {metrics(srv)}"
        stats = {k: v for k, v in m.items() if k.startswith("ouro_engine_stat")}
        print(
            f"\nsoak: {NUM_REQUESTS} requests in {elapsed:.0f} s, {len(results)} completed, "
            f"{m.get('ouro_num_preemptions_total', 0):.0f} preemptions, {m.get('ouro_requests_aborted_total', 0):.0f} "
            f"aborted, {m.get('ouro_generation_tokens_total', 0):.0f} tokens, prefix cache hit rate "
            f"{m.get('ouro_prefix_cache_hit_rate', 0):.2f}"
        )
        assert m.get("ouro_num_preemptions_total", 0) > 0, "the cache was never short: no preemption tested"
        assert m.get("ouro_requests_aborted_total", 0) > 0, stats
        assert m.get("ouro_prefix_cache_hit_rate", 0) > 0.3, stats  # half the prompts share a long prefix
    finally:
        code = srv.stop()
    log = srv.log_text()
    assert "starting a new one" not in log, "the engine process restarted"
    assert "Traceback" not in log, srv.log_tail(80)
    assert code == 0, srv.log_tail()
