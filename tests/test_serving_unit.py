"""Fast tests of the Triton glue without a server: request parsing/validation, response arrays,
incremental detokenization, engine options, and the model repository's generated files."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

from ouro_backend.config import ConfigError, EngineConfig
from ouro_backend.sampling_params import RequestError
from ouro_backend.serving import protocol
from ouro_backend.serving.options import (
    SERVING_KEYS,
    FrontOptions,
    engine_options,
    front_parameters,
    parse_engine_args,
    resolve_model_path,
    tensor_arrays,
    typed_options,
)
from ouro_backend.serving.protocol import (
    CLIENT_INPUTS,
    ENGINE_INPUTS,
    check_parameters,
    engine_response_arrays,
    parse_request,
    postprocess_arrays,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def s(v):  # a batched [1, 1] string tensor
    return np.array([[v.encode() if isinstance(v, str) else v]], dtype=np.object_)


def i32(v):
    return np.array([[v]], dtype=np.int32)


def f32(v):
    return np.array([[v]], dtype=np.float32)


def b(v):
    return np.array([[v]], dtype=np.bool_)


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer

    from ouro_backend.model.toy import build_tokenizer_json

    return Tokenizer.from_str(build_tokenizer_json())


# ---------------------------------------------------------------------------------------------- parsing


def test_parse_full_request():
    req = parse_request(
        {
            "text_input": s("Héllo 🙂"),
            "max_tokens": i32(7),
            "min_tokens": i32(2),
            "stream": b(True),
            "temperature": f32(0.5),
            "top_p": f32(0.9),
            "top_k": i32(5),
            "seed": np.array([[2**63 + 5]], np.uint64),
            "stop_words": np.array([[b"\n\n", b"", "énd".encode()]], dtype=np.object_),
            "ignore_eos": b(True),
            "exclude_input_in_output": b(True),
            "return_num_input_tokens": b(True),
            "return_num_output_tokens": b(False),
            "return_finish_reason": b(True),
            "min_loops": i32(2),
            "max_loops": i32(3),
            "exit_threshold": f32(0.75),
        }
    )
    assert req.prompt == "Héllo 🙂" and req.prompt_text == "Héllo 🙂"
    p = req.params
    assert (p.max_tokens, p.min_tokens, p.top_k, p.seed) == (7, 2, 5, 2**63 + 5)
    assert p.temperature == pytest.approx(0.5) and p.top_p == pytest.approx(0.9)
    assert p.stop == ["\n\n", "énd"]  # empty entries are padding
    assert p.ignore_eos and (p.min_loops, p.max_loops) == (2, 3) and p.exit_threshold == pytest.approx(0.75)
    assert req.stream and req.exclude_input_in_output and not req.echo_prompt
    assert req.return_num_input_tokens and not req.return_num_output_tokens and req.return_finish_reason


def test_parse_stream_interval():
    s = lambda v: np.array([[v.encode()]], dtype=object)  # noqa: E731
    i64 = lambda v: np.array([[v]], dtype=np.int64)  # noqa: E731
    assert protocol.parse_request({"text_input": s("x")}).stream_interval is None  # the server's default
    assert protocol.parse_request({"text_input": s("x"), "stream_interval": i64(1)}).stream_interval == 1
    assert protocol.parse_request({"text_input": s("x"), "stream_interval": i64(0)}).stream_interval == 0
    for bad in (-1, protocol.MAX_STREAM_INTERVAL + 1):
        with pytest.raises(RequestError, match="stream_interval"):
            protocol.parse_request({"text_input": s("x"), "stream_interval": i64(bad)})


def test_parse_sampling_parameters_json():
    """The Triton vLLM backend's `sampling_parameters` input: vLLM's names in one JSON string."""
    js = lambda d: s(json.dumps(d))  # noqa: E731
    req = parse_request(
        {
            "text_input": s("x"),
            "sampling_parameters": js(
                {"max_tokens": 5, "temperature": 0, "top_p": 0.5, "top_k": 3, "seed": 7, "stop": "\n",
                 "ignore_eos": True, "min_tokens": 1, "max_loops": 2, "exit_threshold": 0.25}
            ),
        }
    )  # fmt: skip
    p = req.params
    assert (p.max_tokens, p.min_tokens, p.top_k, p.seed, p.max_loops) == (5, 1, 3, 7, 2)
    assert p.temperature == 0.0 and p.top_p == pytest.approx(0.5) and p.exit_threshold == pytest.approx(0.25)
    assert p.stop == ["\n"] and p.ignore_eos
    both = {"text_input": s("x"), "sampling_parameters": js({"max_tokens": 5, "stop": ["a"]})}
    assert (
        parse_request({**both, "max_tokens": i32(5), "stop_words": np.array([[b"a"]], dtype=object)}).params.max_tokens
        == 5
    )
    with pytest.raises(RequestError, match=r"sampling_parameters.max_tokens \(5\) and the input max_tokens \(6\)"):
        parse_request({**both, "max_tokens": i32(6)})
    for bad, match in [
        ("{oops", "not valid JSON"),
        ("[1]", "must be a JSON object"),
        (json.dumps({"best_of": 2}), "sampling_parameters.best_of is not supported"),
        (json.dumps({"max_tokens": "ten"}), "sampling_parameters.max_tokens must be int, got str"),
        (json.dumps({"max_tokens": True}), "sampling_parameters.max_tokens must be int, got bool"),
        (json.dumps({"stop": [1]}), "sampling_parameters.stop must be a string or a list of strings"),
        (json.dumps({"temperature": -1}), "temperature"),  # SamplingParams' own range check
    ]:
        with pytest.raises(RequestError, match=match):
            parse_request({"text_input": s("x"), "sampling_parameters": s(bad)})
    assert parse_request({"text_input": s("x"), "sampling_parameters": s("")}).params.max_tokens == 16


def test_parse_logprobs_and_penalties():
    """return_logprobs (or vLLM's sampling_parameters.logprobs = 0) and the three penalties, as tensors or
    JSON; every bad value is refused naming the input."""
    js = lambda d: s(json.dumps(d))  # noqa: E731
    x = {"text_input": s("x")}
    plain = parse_request(x)
    assert not plain.return_logprobs and not plain.params.logprobs and not plain.params.penalized
    for req in (
        parse_request({**x, "return_logprobs": b(True)}),
        parse_request({**x, "sampling_parameters": js({"logprobs": 0})}),
    ):
        assert req.return_logprobs and req.params.logprobs and req.return_flags[-1]
    assert not parse_request({**x, "return_logprobs": b(False)}).params.logprobs
    via_tensors = parse_request(
        {**x, "repetition_penalty": f32(1.25), "presence_penalty": f32(-0.5), "frequency_penalty": f32(2.0)}
    ).params
    via_json = parse_request(
        {**x, "sampling_parameters": js({"repetition_penalty": 1.25, "presence_penalty": -0.5, "frequency_penalty": 2})}
    ).params
    for p in (via_tensors, via_json):
        assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.25, -0.5, 2.0)
        assert p.penalized
    assert parse_request({**x, "repetition_penalty": f32(1.0)}).params.penalized is False
    for inputs, match in [
        ({"sampling_parameters": js({"logprobs": 1})}, "sampling_parameters.logprobs must be 0.*top-N"),
        ({"sampling_parameters": js({"logprobs": True})}, "sampling_parameters.logprobs must be int"),
        ({"return_logprobs": i32(1)}, "'return_logprobs' must be TYPE_BOOL"),
        ({"repetition_penalty": f32(0.0)}, "repetition_penalty must be > 0"),
        ({"repetition_penalty": f32(-1.0)}, "repetition_penalty must be > 0"),
        ({"repetition_penalty": f32(float("inf"))}, "'repetition_penalty' must be a finite number"),
        ({"repetition_penalty": s("1.2")}, "'repetition_penalty' must be TYPE_FP32"),
        ({"presence_penalty": f32(2.5)}, r"presence_penalty must be in \[-2, 2\]"),
        ({"frequency_penalty": f32(-2.01)}, r"frequency_penalty must be in \[-2, 2\]"),
        ({"frequency_penalty": f32(float("nan"))}, "'frequency_penalty' must be a finite number"),
        ({"sampling_parameters": js({"presence_penalty": 3})}, r"presence_penalty must be in \[-2, 2\]"),
        ({"sampling_parameters": js({"repetition_penalty": "1"})}, "sampling_parameters.repetition_penalty must be"),
        ({"sampling_parameters": js({"repetition_penalty": 0})}, "repetition_penalty must be > 0"),
        (
            {"sampling_parameters": js({"frequency_penalty": 0.5}), "frequency_penalty": f32(1.0)},
            r"sampling_parameters.frequency_penalty \(0.5\) and the input frequency_penalty \(1.0\) disagree",
        ),
    ]:
        with pytest.raises(RequestError, match=match):
            parse_request({**x, **inputs})
    engine = parse_request(
        {"input_ids": i32([1, 2]), "return_logprobs": b(True), "presence_penalty": f32(1.0)},
        specs=ENGINE_INPUTS,
        prompt_input="input_ids",
    )
    assert engine.params.logprobs and engine.params.presence_penalty == 1.0


def test_parse_bad_words_and_their_tokenization(tokenizer):
    """bad_words as a STRING list input or a JSON string / list; vLLM's tokenization (each word as is and,
    when that is a different token sequence of the same length, with a leading space) and its limits."""
    from ouro_backend.sampling_params import MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS, bad_words_token_ids

    js = lambda d: s(json.dumps(d))  # noqa: E731
    x = {"text_input": s("x")}
    words = np.array([[b"robot", b" hello world", b""]], dtype=object)  # "": padding, as in stop_words
    for req in (
        parse_request({**x, "bad_words": words}),
        parse_request({**x, "sampling_parameters": js({"bad_words": ["robot", " hello world"]})}),
    ):
        assert req.params.bad_words == ["robot", " hello world"] and req.params.processes_logits
        assert not req.params.penalized
    assert parse_request({**x, "sampling_parameters": js({"bad_words": "robot"})}).params.bad_words == ["robot"]
    for inputs, match in [
        ({"bad_words": np.array([[b"  "]], dtype=object)}, "bad_words must be non-blank strings"),
        ({"bad_words": i32(3)}, "'bad_words' must be TYPE_STRING"),
        ({"sampling_parameters": js({"bad_words": [1]})}, "sampling_parameters.bad_words must be a string or a list"),
        (
            {"sampling_parameters": js({"bad_words": ["a"]}), "bad_words": np.array([[b"b"]], dtype=object)},
            r"sampling_parameters.bad_words \(\['a'\]\) and the input bad_words \(\['b'\]\) disagree",
        ),
    ]:
        with pytest.raises(RequestError, match=match):
            parse_request({**x, **inputs})
    enc = lambda t: tokenizer.encode(t, add_special_tokens=False).ids  # noqa: E731
    for word in ("robot", " hello world", "O W"):
        plain, spaced = enc(word.lstrip()), enc(" " + word.lstrip())
        want = [plain] + ([spaced] if spaced[0] != plain[0] and len(spaced) == len(plain) else [])
        assert bad_words_token_ids(tokenizer, [word]) == want
    assert len(bad_words_token_ids(tokenizer, ["O W"])) == 2  # the toy tokenizer has both forms
    with pytest.raises(RequestError, match=f"at most {MAX_BAD_WORDS} are supported"):
        bad_words_token_ids(tokenizer, [f"w{i}" for i in range(MAX_BAD_WORDS + 1)])
    with pytest.raises(RequestError, match=f"bad word .* tokens; 1 to {MAX_BAD_WORD_TOKENS} are supported"):
        bad_words_token_ids(tokenizer, ["héllo wörld: naïve café 🙂 and more words than eight"])


def test_parse_defaults_and_unbatched_shapes():
    req = parse_request({"text_input": np.array([b"hi"], dtype=np.object_), "max_tokens": np.array([3], np.int32)})
    assert req.prompt == "hi" and req.params.max_tokens == 3
    assert not req.stream and req.echo_prompt  # non-streaming echoes the prompt unless excluded
    assert req.params.seed is None and req.params.exit_threshold is None and req.params.max_loops is None
    assert parse_request({"text_input": s("x")}).params.max_tokens == 16


def test_random_seed_alias():
    assert parse_request({"text_input": s("x"), "random_seed": np.array([[9]], np.uint64)}).params.seed == 9
    with pytest.raises(RequestError, match="seed .* random_seed"):
        parse_request(
            {"text_input": s("x"), "seed": np.array([[1]], np.uint64), "random_seed": np.array([[2]], np.uint64)}
        )


@pytest.mark.parametrize(
    "inputs, match",
    [
        ({}, "missing required input 'text_input'"),
        ({"text_input": s("")}, "text_input is empty"),
        ({"text_input": s(b"\xff\xfe")}, "not valid UTF-8"),
        ({"text_input": np.array([[1]], np.int32)}, "text_input.*TYPE_STRING"),
        ({"text_input": s("x"), "max_tokens": f32(3.0)}, "max_tokens.*TYPE_INT64.*float32"),
        ({"text_input": s("x"), "stream": i32(1)}, "stream.*TYPE_BOOL"),
        ({"text_input": s("x"), "temperature": s("hot")}, "temperature.*TYPE_FP32"),
        ({"text_input": s("x"), "max_tokens": i32(-4)}, "max_tokens must be a positive integer, got -4"),
        ({"text_input": s("x"), "max_tokens": i32(0)}, "max_tokens must be a positive integer"),
        (
            {"text_input": s("x"), "min_loops": i32(3), "max_loops": i32(2)},
            r"min_loops \(3\) must not exceed max_loops \(2\)",
        ),
        ({"text_input": s("x"), "exit_threshold": f32(1.5)}, r"exit_threshold must be in \[0, 1\], got 1.5"),
        ({"text_input": s("x"), "exit_threshold": f32(float("nan"))}, "finite"),
        ({"text_input": s("x"), "temperature": f32(-1)}, "temperature must be >= 0"),
        ({"text_input": s("x"), "top_p": f32(0)}, "top_p"),
        ({"text_input": s("x"), "max_tokens": np.array([[1], [2]], np.int32)}, "batch size 2"),
        ({"text_input": np.array([[b"a"], [b"b"]], dtype=np.object_)}, "batch size 2"),
        ({"text_input": s("x"), "max_tokens": np.array([[1, 2]], np.int32)}, "must hold one value"),
        ({"text_input": s("x"), "frobnicate": i32(1)}, "unknown input.*frobnicate.*known inputs: text_input"),
    ],
)
def test_bad_requests(inputs, match):
    with pytest.raises(RequestError, match=match):
        parse_request(inputs, model="ouro")


def test_engine_requests():
    req = parse_request(
        {"input_ids": np.array([[5, 6, 7]], np.int32), "request_id": s("abc"), "text_input": s("p"), "stream": b(True)},
        specs=ENGINE_INPUTS,
        prompt_input="input_ids",
    )
    assert req.prompt == [5, 6, 7] and req.request_id == "abc" and req.prompt_text == "p"
    with pytest.raises(RequestError, match="input_ids is empty"):
        parse_request({"input_ids": np.zeros((1, 0), np.int32)}, specs=ENGINE_INPUTS, prompt_input="input_ids")
    with pytest.raises(RequestError, match="missing required input 'input_ids'"):
        parse_request({"max_tokens": i32(3)}, specs=ENGINE_INPUTS, prompt_input="input_ids")
    abort = parse_request(
        {"input_ids": np.zeros((1, 0), np.int32), "abort_request_id": s("abc")},
        specs=ENGINE_INPUTS,
        prompt_input="input_ids",
    )
    assert abort.abort_request_id == "abc" and abort.prompt is None
    with pytest.raises(RequestError, match="unknown input"):  # text models' inputs are not the engine's
        parse_request(
            {"input_ids": np.array([[1]], np.int32), "text_output": s("x")},
            specs=ENGINE_INPUTS,
            prompt_input="input_ids",
        )


def test_parameters_check():
    check_parameters(None)
    check_parameters("{}")
    check_parameters(
        json.dumps(
            {
                "triton_enable_empty_final_response": True,
                "sequence_id": 0,
                "sequence_start": False,
                "sequence_end": False,
                "priority": 0,
            }
        )
    )
    with pytest.raises(RequestError, match="unknown field.*'max_new_tokens'.*known inputs: text_input"):
        check_parameters(json.dumps({"max_new_tokens": 5}), "ouro")


def test_client_inputs_cover_design():
    design = [
        "text_input",
        "max_tokens",
        "stream",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "random_seed",
        "stop_words",
        "ignore_eos",
        "exclude_input_in_output",
        "return_num_input_tokens",
        "return_num_output_tokens",
        "return_finish_reason",
        "min_loops",
        "max_loops",
        "exit_threshold",
        "return_logprobs",  # the OpenAI frontend's contract: these two names
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
    ]
    assert set(design) <= set(CLIENT_INPUTS)
    assert set(protocol.CLIENT_OUTPUTS) == {
        "text_output",
        "num_input_tokens",
        "num_output_tokens",
        "finish_reason",
        "exit_depths",
        "output_log_probs",
        "num_spec_drafted_tokens",
        "num_spec_accepted_tokens",
        "num_cached_tokens",
    }


# ---------------------------------------------------------------------------------------------- responses


def test_engine_response_arrays():
    out = engine_response_arrays(
        [10, 11], [1, 2, 3], [4, 2], 0, 9, None, "", (True, False, True, True, True, True), (12, 7), 32, [-0.5, -2.0]
    )
    assert out["output_log_probs"].dtype == np.float32 and out["output_log_probs"].tolist() == [[-0.5, -2.0]]
    assert out["return_logprobs"].tolist() == [[True]]
    assert out["output_ids"].dtype == np.int32 and out["output_ids"].tolist() == [[10, 11]]
    assert out["prefix_ids"].tolist() == [[1, 2, 3]] and out["exit_depths"].tolist() == [[4, 2]]
    assert out["num_input_tokens"].tolist() == [[9]] and out["num_output_tokens"].tolist() == [[2]]
    assert out["finish_reason"].tolist() == [[b""]] and out["echo_text"].tolist() == [[b""]]
    assert out["return_num_input_tokens"].tolist() == [[True]] and out["return_finish_reason"].tolist() == [[True]]
    assert out["num_spec_drafted_tokens"].tolist() == [[12]] and out["num_spec_accepted_tokens"].tolist() == [[7]]
    assert out["return_spec_counts"].tolist() == [[True]]
    assert out["num_cached_tokens"].tolist() == [[32]] and out["return_num_cached_tokens"].tolist() == [[True]]
    assert set(out) == set(protocol.ENGINE_OUTPUTS)
    final = engine_response_arrays([], [], [], 0, 9, "abort", "")
    assert final["finish_reason"].tolist() == [[b"cancelled"]] and final["output_ids"].shape == (1, 0)
    assert protocol.finish_reason_name("stop") == "stop" and protocol.finish_reason_name("length") == "length"
    with pytest.raises(ValueError):
        engine_response_arrays([1], [], [], 0, 1, None, "")
    with pytest.raises(ValueError, match="return flags"):
        engine_response_arrays([1], [], [4], 0, 1, None, "", (True, True))
    with pytest.raises(ValueError, match="logprobs"):
        engine_response_arrays([1], [], [4], 0, 1, None, "", log_probs=[-1.0, -2.0])
    assert engine_response_arrays([1], [], [4], 0, 1, None, "")["output_log_probs"].shape == (1, 0)


def _stream(tokenizer, prompt_ids, ids, chunk_sizes, window=5):
    """Engine-like responses: (new ids, prefix = the `window` ids before them)."""
    all_ids, pos, out = list(prompt_ids) + list(ids), 0, []
    sizes = list(chunk_sizes)
    while pos < len(ids):
        n = sizes.pop(0) if sizes else 1
        start = len(prompt_ids) + pos
        out.append((ids[pos : pos + n], all_ids[max(0, start - window) : start]))
        pos += n
    return out


@pytest.mark.parametrize(
    "text",
    [
        " leading spaces  and  double  spaces",
        "héllo wörld: naïve café 🙂🙂 👍 你好，世界。こんにちは Привет 🎉🚀",
        "Emoji: 🙂 😀 😂 👍 🎉",
    ],
)
@pytest.mark.parametrize("chunks", [[1], [2, 3, 1], [100]])
def test_streamed_deltas_concatenate_to_one_shot_text(tokenizer, text, chunks):
    prompt_ids = tokenizer.encode("The prompt:", add_special_tokens=False).ids
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert len(ids) > 5
    responses = _stream(tokenizer, prompt_ids, ids, chunks)
    deltas = []
    for k, (new, prefix) in enumerate(responses):
        final = k == len(responses) - 1
        out = postprocess_arrays(
            tokenizer,
            {
                "output_ids": np.array([new], np.int32),
                "prefix_ids": np.array([prefix], np.int32),
                "trim_chars": i32(0),
                "finish_reason": s("length" if final else ""),
                "exit_depths": np.array([[4] * len(new)], np.int32),
            },
        )
        deltas.append(out["text_output"][0, 0].decode("utf-8"))  # every delta is valid UTF-8
        assert "\ufffd" not in deltas[-1]
    assert "".join(deltas) == tokenizer.decode(ids) == text


@pytest.mark.parametrize("flags", [(False,) * 6, (True,) * 6, (True, False, True, False, True, False)])
@pytest.mark.parametrize("reason, echo, trim", [(None, "", 0), ("stop", "Prompt:", 3), ("abort", "", 0)])
def test_front_responses_equal_the_ensembles_postprocessing(tokenizer, flags, reason, echo, trim):
    """The `ouro` front builds client tensors straight from a response's fields; `ouro_ensemble` goes through
    the engine's tensors and `postprocessing`. Both give the same tensors."""
    ids = tokenizer.encode(" the robot said STOP here", add_special_tokens=False).ids
    fields = dict(
        output_ids=ids,
        prefix_ids=ids[:2],
        exit_depths=[3] * len(ids),
        trim_chars=trim,
        num_input_tokens=9,
        finish_reason=reason,
        echo_text=echo,
        return_flags=flags,
        spec_counts=(12, 7),
        num_cached_tokens=32,
        log_probs=[-0.25 * (i + 1) for i in range(len(ids))],
    )
    direct = protocol.client_response_arrays(tokenizer, **fields)
    via_engine = postprocess_arrays(tokenizer, engine_response_arrays(**fields))
    assert direct.keys() == via_engine.keys()
    for k in direct:
        assert direct[k].dtype == via_engine[k].dtype and direct[k].tolist() == via_engine[k].tolist(), k


def test_postprocess_echo_trim_and_return_flags(tokenizer):
    ids = tokenizer.encode(" the robot said STOP here", add_special_tokens=False).ids
    base = {
        "output_ids": np.array([ids], np.int32),
        "prefix_ids": np.zeros((1, 0), np.int32),
        "trim_chars": i32(len(" here")),
        "finish_reason": s("stop"),
        "exit_depths": np.array([[3] * len(ids)], np.int32),
        "num_input_tokens": i32(4),
        "num_output_tokens": i32(len(ids)),
        "echo_text": s("Prompt:"),
        "num_spec_drafted_tokens": i32(8),
        "num_spec_accepted_tokens": i32(5),
        "num_cached_tokens": i32(16),
    }
    out = postprocess_arrays(tokenizer, base)
    assert out["text_output"][0, 0].decode() == "Prompt: the robot said STOP"
    assert set(out) == {"text_output", "exit_depths"}  # metadata only when asked for
    assert out["exit_depths"].tolist() == [[3] * len(ids)]
    out = postprocess_arrays(
        tokenizer,
        dict(base, return_num_input_tokens=b(True), return_num_output_tokens=b(True), return_finish_reason=b(True)),
    )
    assert out["num_input_tokens"].tolist() == [[4]] and out["num_output_tokens"].tolist() == [[len(ids)]]
    assert out["finish_reason"].tolist() == [[b"stop"]] and "num_spec_drafted_tokens" not in out
    out = postprocess_arrays(tokenizer, dict(base, return_spec_counts=b(True)))
    assert out["num_spec_drafted_tokens"].tolist() == [[8]] and out["num_spec_accepted_tokens"].tolist() == [[5]]
    assert "num_cached_tokens" not in out
    out = postprocess_arrays(tokenizer, dict(base, return_num_cached_tokens=b(True)))
    assert out["num_cached_tokens"].tolist() == [[16]] and "output_log_probs" not in out
    lps = np.array([[-0.5] * len(ids)], np.float32)
    out = postprocess_arrays(tokenizer, dict(base, return_logprobs=b(True), output_log_probs=lps))
    assert out["output_log_probs"].dtype == np.float32 and out["output_log_probs"].tolist() == lps.tolist()
    with pytest.raises(RequestError, match="missing required input 'output_ids'"):
        postprocess_arrays(tokenizer, {"prefix_ids": np.zeros((1, 0), np.int32)})


def test_tokenize_arrays(tokenizer):
    out = protocol.tokenize_arrays(tokenizer, "Hello world")
    assert out["input_ids"].dtype == np.int32 and out["input_ids"].shape[0] == 1
    assert out["input_ids"][0].tolist() == tokenizer.encode("Hello world", add_special_tokens=False).ids


def test_tensor_arrays_reads_each_tensor_once_and_keeps_the_known_names():
    class Tensor:  # the two methods of a Python-backend tensor that tensor_arrays uses
        def __init__(self, name, value):
            self._name, self._value, self.reads = name, np.asarray(value), 0

        def name(self):
            return self._name

        def as_numpy(self):
            self.reads += 1
            return self._value

    tensors = [Tensor("text_input", [[b"hi"]]), Tensor("max_tokens", [[7]]), Tensor("not_ours", [[1]])]
    out = tensor_arrays(tensors, CLIENT_INPUTS)
    assert set(out) == {"text_input", "max_tokens"} and out["max_tokens"].tolist() == [[7]]
    assert [t.reads for t in tensors] == [1, 1, 0]
    assert tensor_arrays([], CLIENT_INPUTS) == {}


# ---------------------------------------------------------------------------------------------- options


def _cfg(**params):
    return {"parameters": {k: {"string_value": v} for k, v in params.items()}}


def test_engine_options_precedence(tmp_path):
    model_dir = tmp_path / "ouro_engine"
    (model_dir / "ckpt").mkdir(parents=True)
    cfg = _cfg(model="ckpt", max_num_seqs="8", block_size="", dtype="${DTYPE}", cancel_check_interval_s="0.05")
    opts, serving = engine_options(cfg, str(model_dir), environ={})
    assert opts == {"model": str(model_dir / "ckpt"), "max_num_seqs": "8"}  # empty / placeholder: unset
    assert serving == {"cancel_check_interval_s": "0.05"}
    env = {"OURO_ENGINE_ARGS": '{"max_num_seqs": 4, "kv_layout": "shared"}', "OURO_MODEL_PATH": "/x/y"}
    opts, _ = engine_options(cfg, str(model_dir), environ=env)
    assert opts == {"model": "/x/y", "max_num_seqs": "4", "kv_layout": "shared"}
    opts, _ = engine_options(_cfg(), None, environ={"OURO_ENGINE_ARGS": "max_num_seqs=2, block_size=32"})
    assert opts == {"max_num_seqs": "2", "block_size": "32"}
    assert EngineConfig.from_strings(opts).block_size == 32
    env = {"OURO_ENGINE_ARGS": "stream_interval=1, metrics_interval_s=0.5, max_num_seqs=2"}
    opts, serving = engine_options(_cfg(stream_interval="4"), None, environ=env)
    assert opts == {"max_num_seqs": "2"}  # serving keys from --engine-arg are not engine options
    assert serving == {"stream_interval": "1", "metrics_interval_s": "0.5"}
    front = front_parameters(_cfg(stream_interval="4", engine_model="ouro_engine"), environ=env)
    assert front == {"stream_interval": "1", "engine_model": "ouro_engine"}  # the streaming keys only
    assert typed_options(FrontOptions, front).stream_interval == 1
    _, serving = engine_options(_cfg(engine_devices="cpu"), None, environ={"OURO_ENGINE_DEVICES": "cuda:0,cuda:1"})
    assert serving == {"engine_devices": "cuda:0,cuda:1"}  # ouro-serve --devices wins over config.pbtxt


def test_engine_option_errors(tmp_path):
    with pytest.raises(ConfigError, match="not key=value"):
        parse_engine_args("max_num_seqs")
    with pytest.raises(ConfigError, match="not valid JSON"):
        parse_engine_args("{oops")
    with pytest.raises(ConfigError, match="unknown engine option 'bogus_option'"):
        EngineConfig.from_strings({"bogus_option": "1"})
    with pytest.raises(ConfigError, match="max_num_seqs"):
        EngineConfig.from_strings({"max_num_seqs": "-3"})
    with pytest.raises(ConfigError, match="no such checkpoint directory"):
        resolve_model_path({"model": str(tmp_path / "missing")})


# ---------------------------------------------------------------------------------------------- repository


def _parse_pbtxt(text):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    cfg = model_config_pb2.ModelConfig()
    text_format.Parse(text, cfg)
    return cfg


def test_repository_matches_protocol():
    """The checked-in config.pbtxt files declare exactly the tensors the models parse (parameters may be
    edited by users; everything else must equal `python -m ouro_backend.serving.repository --write`)."""
    from ouro_backend.serving import repository

    for rel, text in repository.expected_files().items():
        path = os.path.join(ROOT, "model_repository", rel)
        assert os.path.isfile(path), f"{rel} missing: run python -m ouro_backend.serving.repository --write"
        with open(path) as f:
            current = f.read()
        if rel.endswith("model.py"):
            assert current == text, rel
            continue
        got, want = _parse_pbtxt(current), _parse_pbtxt(text)
        got.ClearField("parameters")
        want.ClearField("parameters")
        assert got == want, f"{rel} differs from the generated config: run the repository generator"
    assert os.path.isdir(os.path.join(ROOT, "model_repository", "ouro_ensemble", "1"))


def test_engine_parameters_list_every_option_with_its_default():
    """ouro_engine's config.pbtxt documents every EngineConfig field once, and a default given last in
    brackets is the field's default (a list written by hand drifts: three options once went unlisted)."""
    import dataclasses
    import re

    from ouro_backend.serving import repository

    names = [name for name, _ in repository.ENGINE_PARAMETERS]
    fields = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    assert sorted(names) == sorted(fields) and len(set(names)) == len(names)
    checked = 0
    for name, help_text in repository.ENGINE_PARAMETERS:
        m = re.search(r"\(([^()]*)\)$", help_text)
        if m is None or m.group(1).startswith("default:"):  # no default, or one the engine derives
            continue
        default = fields[name]
        assert default is not None, (name, "a derived default must read 'default: ...'")
        parsed = EngineConfig.from_strings({name: m.group(1)})
        assert getattr(parsed, name) == default, (name, m.group(1), default)
        checked += 1
    assert checked >= 15
    engine = _parse_pbtxt(repository.render()["ouro_engine"])
    assert set(fields) <= set(engine.parameters)


def test_repository_declarations():
    from ouro_backend.serving import repository

    cfgs = {name: _parse_pbtxt(text) for name, text in repository.render().items()}
    for name in ("ouro", "ouro_ensemble"):
        c = cfgs[name]
        assert c.max_batch_size >= 1  # genai-perf / perf_analyzer send [1, 1] shapes
        assert [i.name for i in c.input] == list(protocol.CLIENT_INPUTS)
        assert {o.name for o in c.output} == set(protocol.CLIENT_OUTPUTS)
    assert [i.name for i in cfgs["ouro"].input if not i.optional] == ["text_input"]
    # The ensemble declares text_input optional on purpose (preprocessing then reports it missing; a
    # required-but-missing ensemble input would leave the ensemble answering an empty success).
    assert all(i.optional for i in cfgs["ouro_ensemble"].input)
    assert all(i.optional for i in cfgs["preprocessing"].input)
    assert cfgs["ouro"].model_transaction_policy.decoupled
    assert cfgs["ouro_engine"].model_transaction_policy.decoupled
    assert cfgs["postprocessing"].dynamic_batching.preserve_ordering
    assert cfgs["postprocessing"].instance_group[0].count >= 2
    assert cfgs["preprocessing"].instance_group[0].count >= 2
    engine_params = set(cfgs["ouro_engine"].parameters) - SERVING_KEYS
    assert engine_params <= set(EngineConfig.field_names()), engine_params - set(EngineConfig.field_names())


# ---------------------------------------------------------------------------------------------- launcher


def test_launcher_prepares_pytriton_backend(tmp_path, monkeypatch):
    from ouro_backend.entrypoints import serve, tritonserver

    monkeypatch.setenv("OURO_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TRITONSERVER", raising=False)
    if tritonserver.shutil.which("tritonserver") or tritonserver._pytriton_dirs() is None:
        pytest.skip("tritonserver comes from PATH here, not from the nvidia-pytriton wheel")
    binary, backend_dir, env = tritonserver.find_tritonserver()
    assert os.access(binary, os.X_OK)
    stub = os.path.join(backend_dir, "python", "triton_python_backend_stub")
    assert os.access(stub, os.X_OK) and os.path.isfile(os.path.join(backend_dir, "python", "libtriton_python.so"))
    assert "nvidia_pytriton.libs" in env["LD_LIBRARY_PATH"]
    server = tritonserver.TritonServer(
        model=str(tmp_path), engine_args={"max_num_seqs": "4"}, http_port=1, grpc_port=2, metrics_port=3
    )
    cmd, env = server.command()
    assert env["PATH"].split(os.pathsep)[0] == os.path.dirname(sys.executable)
    assert json.loads(env["OURO_ENGINE_ARGS"]) == {"max_num_seqs": "4"} and env["OURO_MODEL_PATH"] == str(tmp_path)
    assert "--http-port=1" in cmd and f"--backend-directory={backend_dir}" in cmd
    assert not any("-address=" in a for a in cmd)  # tritonserver's default: every interface
    local, _ = tritonserver.TritonServer(model=str(tmp_path), address="127.0.0.1").command()
    assert {"--http-address=127.0.0.1", "--grpc-address=127.0.0.1", "--metrics-address=127.0.0.1"} <= set(local)
    with pytest.raises(tritonserver.ServerError, match="key=value"):
        serve.parse_engine_args(["oops"])


@pytest.mark.parametrize(
    "parameters, expected",
    [
        (None, 0),
        ("", 0),
        ("{}", 0),
        ('{"timeout": 2500000}', 2500000),
        ({"timeout": 7}, 7),
        ({"priority": 1}, 0),
    ],
)
def test_timeout_parameter(parameters, expected):
    from ouro_backend.serving.protocol import timeout_parameter_us

    assert timeout_parameter_us(parameters) == expected


@pytest.mark.parametrize("value", ["soon", -5, True])
def test_bad_timeout_parameter(value):
    from ouro_backend.serving.protocol import timeout_parameter_us

    with pytest.raises(RequestError, match="timeout must be a positive number of microseconds"):
        timeout_parameter_us({"timeout": value})


def test_engine_counts_travel_as_increments_and_levels_as_values():
    """The engine process's MetricsBuffer turns the counts of LLMEngine.stats() (STAT_COUNTERS) into what
    they grew by since the last snapshot, so the server adds them to a Prometheus counter: a restarted engine
    process (a fresh buffer, counts from 0) keeps the counter growing. Levels are left as values."""
    from ouro_backend.serving.metrics import STAT_COUNTERS, STAT_GAUGES, MetricsBuffer

    assert {"launches", "rounds", "steps", "host_syncs"} <= STAT_COUNTERS
    assert not STAT_COUNTERS & STAT_GAUGES
    base = dict(prompt_tokens=0, generation_tokens=0, num_aborted=0, num_preemptions=0)
    buf = MetricsBuffer()
    first = buf.take(dict(base, launches=5, rounds=20, host_syncs=0, kv_blocks_free=90))
    assert first.stat_counters == {"launches": 5, "rounds": 20}  # 0 growth is not sent
    second = buf.take(dict(base, launches=8, rounds=20, host_syncs=1, kv_blocks_free=70))
    assert second.stat_counters == {"launches": 3, "host_syncs": 1}
    assert second.stats is not None and second.stats["kv_blocks_free"] == 70  # a level: its value
    owner = MetricsBuffer()  # the ouro_engine side: snapshots merged until the reporter publishes them
    owner.merge(first)
    owner.merge(second)
    restarted = MetricsBuffer().take(dict(base, launches=2, rounds=4))
    owner.merge(restarted)
    assert owner.take().stat_counters == {"launches": 10, "rounds": 24, "host_syncs": 1}


def test_round_trace_summary_since_leaves_out_earlier_steps(tmp_path):
    """served.py summarizes the timed run only: steps that started before `since` (the warm-up) are out."""
    from ouro_backend.engine.round_trace import COLUMNS, summarize

    rows = [[0.0, 0.5, 128, 0, 1, 1, 1], [10.0, 0.25, 0, 4, 4, 16, 4], [11.0, 0.25, 0, 4, 4, 16, 4]]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"columns": COLUMNS, "rows": rows}))
    everything, timed = summarize(str(path)), summarize(str(path), since=5.0)
    assert everything["steps"] == 3 and everything["prefill_steps"] == 1
    assert timed["steps"] == 2 and timed["prefill_steps"] == 0
    assert timed["mean_running"] == 4.0 and timed["span_s"] == 1.25


def test_request_bursts_from_a_trace(tmp_path):
    """benchmarks/request_bursts.py over a trace written the way the processes write it (the front knows the
    client's request by an alias): 20 requests sent at once, taken alternately by two front instances 1 ms
    apart each, then one request alone."""
    from benchmarks.request_bursts import report

    def write(name, role, marks, aliases=None):
        (tmp_path / f"{name}.json").write_text(json.dumps(dict(role=role, marks=marks, aliases=aliases or {})))

    sent = {f"c{i}": {"sent": 10.0 + i * 1e-4} for i in range(20)}
    sent["c20"] = {"sent": 20.0}
    write("client-1", "client", sent)
    for inst in (0, 1):
        ids = [i for i in range(21) if i % 2 == inst]
        marks = {f"f{i}": {"received": 20.002 if i == 20 else 10.001 + (i // 2) * 1e-3} for i in ids}
        write(f"front-{inst}", "front", marks, {f"c{i}": f"f{i}" for i in ids})
    lines = report(str(tmp_path))
    assert lines[0] == "21 requests in 2 bursts; 95% of them in bursts of >= 16 (largest 20)"
    assert "position  0- 7 in its burst:   9 requests" in lines[1]  # 8 of the burst and the one alone
    assert "position 16-23 in its burst:   4 requests" in lines[3]
    assert lines[4].endswith("each front instance took one request every 1.00 ms (median)")
    assert lines[5] == "requests per front instance: front-0.json 11, front-1.json 10"
