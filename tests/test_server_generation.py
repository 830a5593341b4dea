"""Generation through a real tritonserver: gRPC and HTTP streaming, non-streaming, stop words, seeds,
concurrency, one stream for many requests and the load generator, each compared with the offline engine.

The shared server is conftest.py's session fixture `server`; the helpers are in server_common.py."""

from __future__ import annotations

import json
import queue
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from server_common import PROMPT, PROMPTS, all_flags, offline

from client.ouro_client import GrpcStream, generate, request_options

pytestmark = pytest.mark.timeout(300)


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
@pytest.mark.parametrize("interval", [1, 3])
def test_stream_interval_gives_fixed_size_responses_and_the_same_result(server, llm, model, interval):
    """stream_interval N: every response but the last carries exactly N tokens (1: one token per response),
    and the stream's text, token count and exit depths equal the offline engine's, as the default
    (coalescing) stream's do."""
    ref = offline(llm, PROMPT, max_tokens=23, temperature=0.0, exit_threshold=0.7)
    opts = all_flags(max_tokens=23, temperature=0.0, exit_threshold=0.7, stream_interval=interval)
    r = generate(server.grpc_url, model, PROMPT, opts)
    assert r.error is None
    sizes = [c.num_output_tokens for c in r.chunks]
    assert sizes[:-1] == [interval] * (len(sizes) - 1) and 1 <= sizes[-1] <= interval, sizes
    assert all(c.num_output_tokens == len(c.exit_depths) for c in r.chunks)
    assert r.text == ref.text and r.exit_depths == ref.exit_depths and r.num_tokens == len(ref.token_ids)


def test_bad_stream_interval_is_refused_and_the_server_serves_on(server, llm):
    r = generate(server.grpc_url, "ouro", PROMPT, all_flags(max_tokens=4, stream_interval=-1))
    assert r.error is not None and "stream_interval" in r.error
    ok = generate(server.grpc_url, "ouro", PROMPT, all_flags(max_tokens=4, temperature=0.0))
    assert ok.error is None and ok.num_tokens == 4


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
    opts = request_options(
        max_tokens=8, temperature=0.0, stream=True, return_num_cached_tokens=True, return_num_input_tokens=True
    )
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
    for name, arr, dt in [
        ("input_ids", ids, "INT32"),
        ("max_tokens", np.array([[12]], np.int64), "INT64"),
        ("temperature", np.array([[0.0]], np.float32), "FP32"),
        ("exit_threshold", np.array([[0.5]], np.float32), "FP32"),
        ("stream", np.array([[True]]), "BOOL"),
        ("return_logprobs", np.array([[True]]), "BOOL"),
    ]:
        t = grpcclient.InferInput(name, list(arr.shape), dt)
        t.set_data_from_numpy(arr)
        inputs.append(t)
    client = grpcclient.InferenceServerClient(server.grpc_url)
    q: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    client.async_stream_infer("ouro_engine", inputs, enable_empty_final_response=True)
    out_ids, depths, reasons, logprobs = [], [], [], []
    while True:
        result, error = q.get(timeout=60)
        assert error is None, error
        if result.get_response().outputs:
            out_ids += result.as_numpy("output_ids").reshape(-1).tolist()
            depths += result.as_numpy("exit_depths").reshape(-1).tolist()
            logprobs += result.as_numpy("output_log_probs").reshape(-1).tolist()
            reasons.append(result.as_numpy("finish_reason").reshape(-1)[0].decode())
        if result.get_response().parameters["triton_final_response"].bool_param:
            break
    client.stop_stream()
    client.close()
    assert out_ids == ref.token_ids and depths == ref.exit_depths
    assert np.allclose(logprobs, ref.logprobs, atol=1e-5, rtol=0)
    assert reasons[-1] == ref.finish_reason and set(reasons[:-1]) <= {""}


# ------------------------------------------------------------------------------------------- non-streaming


@pytest.mark.parametrize("model", ["ouro", "ouro_ensemble"])
def test_non_streaming(server, llm, model):
    prompt = " leading space, 🙂 and  two spaces"
    ref = offline(llm, prompt, max_tokens=16, temperature=0.0)
    # Default: one response, the prompt echoed before the generated text (like the vLLM / TRT-LLM backends).
    r = generate(
        server.http_url, model, prompt, all_flags(max_tokens=16, temperature=0.0, stream=False), protocol="http"
    )
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
    body = json.dumps(
        {
            "text_input": PROMPT,
            "max_tokens": 8,
            "temperature": 0,
            "exclude_input_in_output": True,
            "return_num_output_tokens": True,
            "return_finish_reason": True,
        }
    ).encode()
    req = urllib.request.Request(
        f"http://{server.http_url}/v2/models/ouro/generate", data=body, headers={"Content-Type": "application/json"}
    )
    data = json.loads(urllib.request.urlopen(req, timeout=60).read())
    assert data["text_output"] == ref.text and data["num_output_tokens"] == len(ref.token_ids)
    assert data["finish_reason"] == ref.finish_reason
    assert data["exit_depths"] == ref.exit_depths


@pytest.mark.parametrize("model", ["ouro", "ouro_ensemble"])
def test_http_sampling_parameters_json_as_the_vllm_backend_takes_it(server, llm, model):
    """A client written for the Triton vLLM backend sends its options as one JSON string; a key we do not
    support is an HTTP 400 naming it, and the server serves on."""
    ref = offline(llm, PROMPT, max_tokens=8, temperature=0.0, stop=["qz"])
    url = f"http://{server.http_url}/v2/models/{model}/generate"

    def post(sampling: dict):
        body = {"text_input": PROMPT, "exclude_input_in_output": True, "sampling_parameters": json.dumps(sampling)}
        req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        return json.loads(urllib.request.urlopen(req, timeout=60).read())

    data = post({"max_tokens": 8, "temperature": 0, "stop": ["qz"]})
    assert data["text_output"] == ref.text and data["exit_depths"] == ref.exit_depths
    with pytest.raises(urllib.error.HTTPError) as e:
        post({"max_tokens": 8, "best_of": 2})
    assert e.value.code == 400 and "sampling_parameters.best_of is not supported" in e.value.read().decode()
    assert post({"max_tokens": 8, "temperature": 0, "stop": ["qz"]})["text_output"] == ref.text


@pytest.mark.parametrize("model", ["ouro", "ouro_ensemble"])
def test_logprobs_streamed_coalesced_one_by_one_and_not_streamed_agree(server, llm, model):
    """return_logprobs: output_log_probs holds one logprob per token of each response, and the stream's
    (coalesced, or one token per response) and the one non-streaming response's (HTTP generate) are the
    offline engine's; without the flag there is no output_log_probs."""
    ref = offline(llm, PROMPT, max_tokens=12, temperature=0.0)
    opts = all_flags(max_tokens=12, temperature=0.0, return_logprobs=True)
    runs = {
        "coalesced": generate(server.grpc_url, model, PROMPT, opts),
        "interval 1": generate(server.grpc_url, model, PROMPT, dict(opts, stream_interval=1)),
        "not streamed": generate(server.http_url, model, PROMPT, dict(opts, stream=False), protocol="http"),
    }
    assert len(runs["interval 1"].chunks) >= 12 and len(runs["not streamed"].chunks) == 1
    for what, r in runs.items():
        assert r.error is None, what
        assert all(c.log_probs is not None and len(c.log_probs) == len(c.exit_depths) for c in r.chunks), what
        assert len(r.log_probs) == 12 and np.allclose(r.log_probs, ref.logprobs, atol=1e-5, rtol=0), what
    plain = generate(server.grpc_url, model, PROMPT, all_flags(max_tokens=3, temperature=0.0))
    assert plain.error is None and all(c.log_probs is None for c in plain.chunks)


def test_penalties_through_sampling_parameters_json_and_tensors_agree(server, llm):
    """The penalties and bad words as the vLLM backend's JSON keys (with vLLM's logprobs: 0) or as their own
    tensors, through either client-facing model: the offline engine's text, which they change."""
    pen = dict(repetition_penalty=0.6, presence_penalty=-1.0, frequency_penalty=0.5)
    penalized = offline(llm, PROMPT, max_tokens=12, temperature=0.0, **pen)
    assert penalized.text != offline(llm, PROMPT, max_tokens=12, temperature=0.0).text
    tok = llm.engine.tokenizer
    words = [tok.decode([t]) for t in penalized.token_ids]
    bad = [next(w for w in words if w.strip() and "\ufffd" not in w)]  # a whole token of the penalized text
    ref = offline(llm, PROMPT, max_tokens=12, temperature=0.0, bad_words=bad, **pen)
    assert ref.text != penalized.text
    opts = all_flags(max_tokens=12, temperature=0.0, bad_words=bad, **pen)
    tensors = generate(server.grpc_url, "ouro_ensemble", PROMPT, opts)
    sampling = json.dumps({"max_tokens": 12, "temperature": 0, "logprobs": 0, "bad_words": bad, **pen})
    opts = {"stream": False, "exclude_input_in_output": True, "sampling_parameters": sampling}
    via_json = generate(server.http_url, "ouro", PROMPT, opts, protocol="http")
    assert tensors.error is None and via_json.error is None
    assert tensors.text == via_json.text == ref.text
    assert np.allclose(via_json.log_probs, ref.logprobs, atol=1e-5, rtol=0)


def test_stop_words(server, llm):
    ref = offline(llm, PROMPT, max_tokens=30, temperature=0.0)
    # a stop string taken from the middle of the greedy text: the output must end right before it
    text = ref.text
    start = next(i for i in range(6, len(text) - 3) if "\ufffd" not in text[i : i + 3] and text[i : i + 3].strip())
    stop = text[start : start + 3]
    expect = offline(llm, PROMPT, max_tokens=30, temperature=0.0, stop=[stop])
    assert expect.finish_reason == "stop" and stop not in expect.text
    for model in ("ouro", "ouro_ensemble"):
        for stream in (True, False):
            r = generate(
                server.grpc_url,
                model,
                PROMPT,
                all_flags(
                    max_tokens=30, temperature=0.0, stream=stream, exclude_input_in_output=True, stop_words=[stop]
                ),
            )
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
    jobs = [("ouro", PROMPTS[i % len(PROMPTS)]) for i in range(16)] + [
        ("ouro_ensemble", PROMPTS[i % len(PROMPTS)]) for i in range(8)
    ]
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

    opts = request_options(
        max_tokens=8, stream=True, ignore_eos=True, exclude_input_in_output=True, return_num_output_tokens=True
    )
    for processes in (1, 2):  # workers in this process; spread over two client processes
        report = run_load(server.grpc_url, "ouro", 4, 12, 120.0, opts, PROMPTS, processes=processes)
        assert report["errors"] == 0, report["error_samples"]
        assert report["requests"] == 12 and report["output_tokens"] == 12 * 8
        assert report["unfinished_workers"] == 0 and report["ttft_s"]["p50"] > 0
        assert report["client_processes"] == processes
        assert 0 < report["mean_in_flight"] <= 4  # at most the workers' requests are open at once
        assert report["turnaround_s"]["p50"] >= 0  # 12 requests over 4 workers: 8 turnarounds
        assert 0 <= report["tail_s"] <= report["duration_s"]
