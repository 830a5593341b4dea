"""The OpenAI-compatible API (ouro_backend/entrypoints/openai_api.py) through `ouro-serve --openai-port`, the
real tritonserver and the demo model (the default model, which has a chat template), called with the official
`openai` client: completions and chat, streaming and not, against the `ouro` model's own generate endpoint;
usage counts, exit depths, stop strings, echo, Ouro's extra fields, logprobs, cancellation of a stream and of
a whole answer (KV freed), bad input as OpenAI error objects with the server still serving, the API inside
ouro-serve's readiness and stopped with it, and a busy port refused before anything starts. The request rules
of openai_protocol.py alone: the unit tests at the end."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import urllib.request
from types import SimpleNamespace

import pytest
from helpers import ouro_serve_cmd, processes, read_until_ready, wait_for
from server_common import metrics

from ouro_backend.entrypoints.chat_template import ChatTemplate
from ouro_backend.entrypoints.openai_protocol import APIError, ModelInfo, parse_chat, parse_completion
from ouro_backend.entrypoints.tritonserver import ServerError, find_tritonserver, free_port
from ouro_backend.models import DEMO_MODEL

openai = pytest.importorskip("openai")  # the `test` extra installs it: a missing client fails CI's setup first

pytestmark = pytest.mark.timeout(300)
PROMPT = "It is a truth universally acknowledged, that"


def serve_cmd(tmp_path, http: int, grpc: int, metrics_port: int, openai_port: int) -> list[str]:
    """`ouro-serve` with its default model (the demo model) and the OpenAI API on `openai_port`."""
    return ouro_serve_cmd(
        None, str(tmp_path / "server.log"), http, grpc, metrics_port, "--openai-port", str(openai_port)
    )


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    """ouro-serve with the demo model and the OpenAI API: (openai client, HTTP generate URL, metrics handle)."""
    try:
        find_tritonserver()
    except ServerError as e:
        pytest.skip(f"no tritonserver available: {e}")
    tmp = tmp_path_factory.mktemp("openai")
    ports = [free_port() for _ in range(4)]
    env = {k: v for k, v in os.environ.items() if k != "OURO_MODEL_PATH"}
    proc = subprocess.Popen(
        serve_cmd(tmp, *ports), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    base = f"http://127.0.0.1:{ports[3]}"
    try:
        read_until_ready(proc, tmp / "server.log")
        # "ready" includes the API: it answers at once, and knows the `ouro` model
        assert json.loads(urllib.request.urlopen(base + "/health", timeout=10).read()) == {"ready": True}
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        yield SimpleNamespace(
            client=client,
            generate_url=f"http://127.0.0.1:{ports[0]}/v2/models/ouro/generate",
            server=SimpleNamespace(metrics_url=f"http://127.0.0.1:{ports[2]}/metrics"),
            base=base,
            port=ports[3],
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=120)[0]
        assert proc.returncode == 0, rest
        assert "Traceback" not in (tmp / "server.log.openai-api").read_text()
    with pytest.raises(OSError):  # stopped with ouro-serve
        socket.create_connection(("127.0.0.1", ports[3]), timeout=5).close()


def generate(api, prompt: str, **fields) -> dict:
    """The `ouro` model's own non-streaming generate: the reference text and counts."""
    body = {
        "text_input": prompt,
        "exclude_input_in_output": True,
        "return_num_input_tokens": True,
        "return_num_output_tokens": True,
        "return_finish_reason": True,
        **fields,
    }
    req = urllib.request.Request(
        api.generate_url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    return json.loads(urllib.request.urlopen(req, timeout=120).read())


def test_models_lists_the_served_model(api):
    ids = [m.id for m in api.client.models.list().data]
    assert ids == ["ouro"]
    with pytest.raises(openai.NotFoundError, match="does not exist") as e:
        api.client.completions.create(model="gpt-4", prompt=PROMPT)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"


def test_completion_text_usage_and_depths_equal_generate(api):
    want = generate(api, PROMPT, max_tokens=12, temperature=0)
    got = api.client.completions.create(model="ouro", prompt=PROMPT, max_tokens=12, temperature=0)
    choice = got.choices[0]
    assert choice.text == want["text_output"] and choice.text
    assert got.usage.completion_tokens == want["num_output_tokens"] == 12
    assert got.usage.prompt_tokens == want["num_input_tokens"]
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens
    assert choice.finish_reason == "length"
    assert choice.model_extra["exit_depths"] == want["exit_depths"] and len(want["exit_depths"]) == 12


def test_streamed_completion_joins_to_the_same_text_with_usage(api):
    want = api.client.completions.create(model="ouro", prompt=PROMPT, max_tokens=12, temperature=0)
    chunks = list(
        api.client.completions.create(
            model="ouro",
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    depths = [d for c in chunks if c.choices for d in c.choices[0].model_extra["exit_depths"]]
    assert text == want.choices[0].text
    assert depths == want.choices[0].model_extra["exit_depths"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices
    echoed = api.client.completions.create(model="ouro", prompt=PROMPT, max_tokens=12, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + text
    streamed = api.client.completions.create(
        model="ouro", prompt=PROMPT, max_tokens=12, temperature=0, echo=True, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == PROMPT + text


def test_chat_renders_the_template_streamed_and_not(api):
    messages = [{"role": "user", "content": "Who is Mr. Darcy?"}]
    rendered = ChatTemplate.of(DEMO_MODEL).render(messages)
    want = generate(api, rendered, max_tokens=10, temperature=0)
    got = api.client.chat.completions.create(model="ouro", messages=messages, max_tokens=10, temperature=0)
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want["text_output"]
    assert got.usage.prompt_tokens == want["num_input_tokens"]
    stream = api.client.chat.completions.create(
        model="ouro", messages=messages, max_completion_tokens=10, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want["text_output"]
    assert [d for c in chunks for d in c.choices[0].model_extra.get("exit_depths", [])] == want["exit_depths"]
    scored = api.client.chat.completions.create(
        model="ouro", messages=messages, max_tokens=10, temperature=0, logprobs=True
    )
    content = scored.choices[0].logprobs.content
    assert len(content) == 10 and all(c.logprob <= 0 for c in content)
    assert "".join(c.token for c in content) == want["text_output"]
    with pytest.raises(openai.BadRequestError, match="only the sampled token's logprob"):
        api.client.chat.completions.create(model="ouro", messages=messages, logprobs=True, top_logprobs=2)


def test_stop_seed_and_ouro_fields(api):
    full = api.client.completions.create(model="ouro", prompt=PROMPT, max_tokens=24, temperature=0).choices[0]
    stop = full.text[5:8]
    cut = api.client.completions.create(model="ouro", prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and full.text.startswith(cut.choices[0].text)
    assert stop not in cut.choices[0].text
    shallow = api.client.completions.create(
        model="ouro", prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"max_loops": 1}
    )
    depths = shallow.choices[0].model_extra["exit_depths"]
    assert depths == generate(api, PROMPT, max_tokens=8, temperature=0, max_loops=1)["exit_depths"]
    assert depths[1:] == [1] * 7  # the first token comes from the prompt, which runs every loop
    sampled = [
        api.client.completions.create(model="ouro", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=7)
        .choices[0]
        .text
        for _ in range(2)
    ]
    assert sampled[0] == sampled[1]


def test_logprobs_are_the_sampled_tokens(api):
    got = api.client.completions.create(model="ouro", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0)
    lp = got.choices[0].logprobs
    assert len(lp.token_logprobs) == got.usage.completion_tokens == 6
    assert all(x <= 0 for x in lp.token_logprobs)
    assert "".join(lp.tokens) == got.choices[0].text
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(6)]
    with pytest.raises(openai.BadRequestError, match="only the sampled token's logprob"):
        api.client.completions.create(model="ouro", prompt=PROMPT, max_tokens=6, logprobs=3)


def test_bad_input_is_an_openai_error_and_the_server_carries_on(api):
    with pytest.raises(openai.BadRequestError) as e:
        api.client.completions.create(model="ouro", prompt=PROMPT, n=2)
    assert e.value.body["param"] == "n" and e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="max_tokens must be at least 1"):
        api.client.completions.create(model="ouro", prompt=PROMPT, max_tokens=-3)
    with pytest.raises(openai.BadRequestError, match="max_tokens must be an integer"):
        api.client.completions.create(model="ouro", prompt=PROMPT, extra_body={"max_tokens": "ten"})
    with pytest.raises(openai.BadRequestError, match="context limit"):  # the model's own check, its message
        api.client.completions.create(model="ouro", prompt=PROMPT, max_tokens=10**6)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        api.client.completions.create(model="ouro", prompt=PROMPT, temperature=-1, stream=True)
    req = urllib.request.Request(api.base + "/v1/completions", data=b"{not json", method="POST")
    with pytest.raises(urllib.error.HTTPError) as http_error:
        urllib.request.urlopen(req, timeout=30)
    assert http_error.value.code == 400 and "error" in json.loads(http_error.value.read())
    assert api.client.completions.create(model="ouro", prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2


def test_a_client_that_goes_away_cancels_its_request(api):
    """A closed stream, and a client that stops waiting for a whole answer: both requests are aborted in the
    engine and their KV freed."""
    before = metrics(api.server)
    long = dict(model="ouro", prompt=PROMPT, max_tokens=1500, temperature=0, extra_body={"ignore_eos": True})
    stream = api.client.completions.create(stream=True, **long)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    with pytest.raises(openai.APITimeoutError):
        api.client.with_options(timeout=1.0).completions.create(**long)

    def freed():
        m = metrics(api.server)
        return (
            m.get("ouro_requests_aborted_total", 0) >= before.get("ouro_requests_aborted_total", 0) + 2
            and m.get("ouro_kv_cache_usage_ratio", 1) == 0
            and m.get("ouro_num_requests_running", 1) == 0
        ) and m

    m = wait_for(freed, timeout=30)
    assert m, f"a request whose client went away still runs or holds KV: {metrics(api.server)}"
    assert m["ouro_generation_tokens_total"] - before.get("ouro_generation_tokens_total", 0) < 1500


def test_the_api_process_is_started_again_when_it_dies(api):
    def api_pids():
        port = str(api.port).encode()
        return [pid for pid, argv in processes() if b"ouro_backend.entrypoints.openai_api" in argv and port in argv]

    (pid,) = api_pids()
    os.kill(pid, signal.SIGKILL)

    def serving_again():
        try:
            return [p for p in api_pids() if p != pid] and api.client.models.list().data
        except openai.APIConnectionError:
            return False

    assert wait_for(serving_again, timeout=30), "the OpenAI API was not started again"
    assert api.client.completions.create(model="ouro", prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2


def test_a_busy_openai_port_fails_fast_and_leaves_nothing(tmp_path):
    try:
        find_tritonserver()
    except ServerError as e:
        pytest.skip(f"no tritonserver available: {e}")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = subprocess.run(
            serve_cmd(tmp_path, free_port(), free_port(), free_port(), port),
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"OpenAI API port {port} (--openai-port) on 127.0.0.1 is already in use" in r.stderr
    assert "ready" not in r.stdout and "starting" not in r.stdout  # refused before anything started
    assert not list(tmp_path.iterdir())  # no server log: nothing ran


# ---- the request rules alone (openai_protocol.py) ----
MODEL = ModelInfo(frozenset({"text_input", "max_tokens", "temperature", "seed", "max_loops"}), frozenset())


def refusal(parse, body: dict) -> APIError:
    with pytest.raises(APIError) as e:
        parse({"model": "ouro", **body})
    assert e.value.status == 400 and e.value.body()["error"]["type"] == "invalid_request_error"
    return e.value


@pytest.mark.unit
def test_completion_fields_become_ouro_inputs_and_unknown_fields_are_ignored():
    req = parse_completion(
        {"prompt": ["hi"], "max_tokens": 5, "temperature": 0, "seed": 2**64 - 1, "stop": "x", "user": "u"}, MODEL
    )
    assert req.prompt == "hi" and not req.stream and not req.logprobs
    assert req.inputs == {"max_tokens": 5, "temperature": 0, "seed": 2**64 - 1, "stop_words": ["x"]}
    assert parse_completion({"prompt": "hi"}, MODEL).inputs == {"max_tokens": 16}  # OpenAI's default


@pytest.mark.unit
@pytest.mark.parametrize(
    "body, param, message",
    [
        ({"n": 2}, "n", "n must be 1"),
        ({"best_of": 3}, "best_of", "best_of must be 1"),
        ({"max_tokens": 0}, "max_tokens", "at least 1"),
        ({"max_tokens": 2.5}, "max_tokens", "must be an integer"),
        ({"temperature": True}, "temperature", "must be a number"),
        ({"temperature": float("nan")}, "temperature", "finite"),
        ({"seed": -1}, "seed", "must be in [0, "),
        ({"max_loops": 2**63}, "max_loops", "must be in ["),
        ({"top_k": 5}, "top_k", "not supported by this server's model"),  # the model has no such input
        ({"stop": ["ok", ""]}, "stop", "non-empty string"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed with stream"),
        ({"logprobs": 0}, "logprobs", "no output_log_probs output"),
        ({"logprobs": 2}, "logprobs", "only the sampled token's logprob"),
        ({"response_format": {"type": "json_object"}}, "response_format", "not supported"),
        ({"prompt": [1, 2, 3]}, "prompt", "token ids are not supported"),
    ],
)
def test_bad_completion_fields_are_refused_by_name(body, param, message):
    e = refusal(lambda b: parse_completion({"prompt": "hi", **b}, MODEL), body)
    assert e.param == param and message in e.message


@pytest.mark.unit
def test_chat_renders_text_parts_and_refuses_without_a_template(tmp_path):
    template = ChatTemplate.of(DEMO_MODEL)
    assert template is not None
    parts = [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "Emma"}]
    req = parse_chat({"messages": [{"role": "user", "content": parts}], "max_completion_tokens": 3}, template, MODEL)
    assert req.prompt == template.render([{"role": "user", "content": "Hello, Emma"}])
    assert "Hello, Emma" in req.prompt and req.inputs["max_tokens"] == 3
    assert parse_chat({"messages": [{"role": "user", "content": "x"}]}, template, MODEL).inputs["max_tokens"] is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    assert ChatTemplate.of(tmp_path) is None
    e = refusal(lambda b: parse_chat(b, None, MODEL), {"messages": [{"role": "user", "content": "x"}]})
    assert "no chat template" in e.message
    e = refusal(lambda b: parse_chat(b, template, MODEL), {"messages": [{"role": "user", "content": 3}]})
    assert "messages[0].content" in e.message
    image = [{"type": "image_url", "image_url": {"url": "x"}}]
    e = refusal(lambda b: parse_chat(b, template, MODEL), {"messages": [{"role": "user", "content": image}]})
    assert "only text parts" in e.message
    refusing = ChatTemplate("{{ raise_exception('roles must alternate') }}")
    e = refusal(lambda b: parse_chat(b, refusing, MODEL), {"messages": [{"role": "user", "content": "x"}]})
    assert "roles must alternate" in e.message
