"""Tensor names, request parsing and response arrays shared by the Triton models.

Pure numpy: nothing here imports Triton, so all of it is unit-tested without a server
(tests/test_serving_unit.py). The Triton models (`ouro_backend/serving/*_model.py`) read the request's
tensors into a `{name: np.ndarray}` dict and hand it to `parse_request`; every bad value raises
`RequestError` with a message naming the input, which the models return as a `TritonError`.

Shapes: every model in the repository has `max_batch_size >= 1`, so a tensor arrives as `[batch, ...]`
(`[1, 1]` for a scalar such as `max_tokens`, `[1, n]` for a list such as `input_ids`). Only batch 1 is
accepted (one prompt per request, as the vLLM and TensorRT-LLM backends do for decoupled models).
Parsing also accepts unbatched arrays (`[1]`, `[n]`), so a model configured with `max_batch_size: 0`
works unchanged.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..sampling_params import RequestError, SamplingParams


@dataclass(frozen=True)
class InputSpec:
    name: str
    triton_dtype: str  # as in config.pbtxt without the TYPE_ prefix
    kind: str  # int | uint | float | bool | str
    is_list: bool = False
    doc: str = ""


def _spec(*specs: InputSpec) -> dict[str, InputSpec]:
    return {s.name: s for s in specs}


# Per-request options, shared by the client-facing models (`ouro`, `ouro_ensemble`) and `ouro_engine`.
# Names follow the TensorRT-LLM / vLLM backends so genai-perf, perf_analyzer and the OpenAI frontend work.
# NOTE: integers are INT64, not TensorRT-LLM's INT32: Triton's JSON layer casts a JSON number to the
# declared type without a range check (max_tokens 4294967299 arrived as 3), and with INT64 the model sees
# the value and refuses it. Clients that take types from the model metadata (perf_analyzer, genai-perf) are
# unaffected; a client that sends INT32 tensors gets Triton's "unexpected datatype" error.
SAMPLING_INPUTS = _spec(
    InputSpec("max_tokens", "INT64", "int", doc="tokens to generate (default 16)"),
    InputSpec("min_tokens", "INT64", "int", doc="generate at least this many tokens before EOS / stop words"),
    InputSpec("stream", "BOOL", "bool", doc="one response per new piece of text (default false: one response)"),
    InputSpec(
        "stream_interval",
        "INT64",
        "int",
        doc="streaming: tokens per response, 1 = exactly one token per response, 0 = every token waiting "
        "when the sender gets to the stream (default: the model's stream_interval parameter)",
    ),
    InputSpec("temperature", "FP32", "float", doc="0: greedy (default 1.0)"),
    InputSpec("top_p", "FP32", "float"),
    InputSpec("top_k", "INT64", "int", doc="0 or -1: off"),
    InputSpec("seed", "UINT64", "uint", doc="per-request sampling seed"),
    InputSpec("random_seed", "UINT64", "uint", doc="alias of seed (TensorRT-LLM's name)"),
    InputSpec("stop_words", "STRING", "str", is_list=True, doc="stop strings (not included in the output)"),
    InputSpec(
        "bad_words",
        "STRING",
        "str",
        is_list=True,
        doc="words never generated (vLLM's bad_words: each as is and with a leading space)",
    ),
    InputSpec("ignore_eos", "BOOL", "bool"),
    InputSpec(
        "exclude_input_in_output",
        "BOOL",
        "bool",
        doc="non-streaming only: do not echo the prompt before the generated text",
    ),
    InputSpec("min_loops", "INT64", "int", doc="Ouro: a token runs at least this many loops (default 1)"),
    InputSpec("max_loops", "INT64", "int", doc="Ouro: a token runs at most this many loops (default: the model's)"),
    InputSpec(
        "exit_threshold",
        "FP32",
        "float",
        doc="Ouro: exit when the gate's exit probability reaches it (1.0: fixed depth max_loops)",
    ),
    InputSpec("exit_trace", "INT64", "int", is_list=True, doc="Ouro: depths to replay (engine exit_mode=trace)"),
    InputSpec(
        "repetition_penalty",
        "FP32",
        "float",
        doc="> 0, 1 = off: logits of tokens seen in prompt or output divided (positive) / multiplied (negative) by it",
    ),
    InputSpec(
        "presence_penalty", "FP32", "float", doc="[-2, 2], 0 = off: subtracted from tokens the output already has"
    ),
    InputSpec(
        "frequency_penalty",
        "FP32",
        "float",
        doc="[-2, 2], 0 = off: times its count in the output, subtracted from each token's logit",
    ),
    InputSpec(
        "sampling_parameters",
        "STRING",
        "str",
        doc="a JSON object of the options above, as the Triton vLLM backend takes it (`SAMPLING_JSON_KEYS`)",
    ),
)
# The keys a `sampling_parameters` JSON object may hold, and the JSON types each takes (vLLM's names; `stop`
# is stop_words, a string or a list of strings). Other vLLM keys are refused by name.
SAMPLING_JSON_KEYS: dict[str, tuple[type, ...]] = {
    "max_tokens": (int,),
    "min_tokens": (int,),
    "temperature": (int, float),
    "top_p": (int, float),
    "top_k": (int,),
    "seed": (int,),
    "stop": (str, list),
    "bad_words": (str, list),
    "ignore_eos": (bool,),
    "min_loops": (int,),
    "max_loops": (int,),
    "exit_threshold": (int, float),
    "repetition_penalty": (int, float),
    "presence_penalty": (int, float),
    "frequency_penalty": (int, float),
    "logprobs": (int,),  # 0 only (vLLM: the sampled token's logprob, no alternatives): return_logprobs
}
RETURN_FLAGS = _spec(
    InputSpec("return_num_input_tokens", "BOOL", "bool"),
    InputSpec("return_num_output_tokens", "BOOL", "bool"),
    InputSpec("return_finish_reason", "BOOL", "bool"),
    InputSpec(
        "return_spec_counts",
        "BOOL",
        "bool",
        doc="self-speculation: return num_spec_drafted_tokens / num_spec_accepted_tokens (request totals)",
    ),
    InputSpec(
        "return_num_cached_tokens",
        "BOOL",
        "bool",
        doc="return num_cached_tokens: prompt tokens whose KV came from the prefix cache",
    ),
    InputSpec(
        "return_logprobs",
        "BOOL",
        "bool",
        doc="return output_log_probs: each new token's logprob under the model (before penalties and temperature)",
    ),
)
TEXT_INPUT = InputSpec("text_input", "STRING", "str", doc="the prompt (required)")
# What a client may send to `ouro` / `ouro_ensemble`.
CLIENT_INPUTS = {TEXT_INPUT.name: TEXT_INPUT, **SAMPLING_INPUTS, **RETURN_FLAGS}
# What `ouro_engine` takes: token ids instead of text, plus two control inputs (choose the request id; abort by id).
# `text_input` and the `return_*` flags only pass through to the outputs (an ensemble step after a decoupled
# model may only read that model's outputs, so post-processing gets them from the engine).
ENGINE_INPUTS = _spec(
    InputSpec("input_ids", "INT32", "int", is_list=True, doc="prompt token ids (required)"),
    *SAMPLING_INPUTS.values(),
    *RETURN_FLAGS.values(),
    InputSpec("text_input", "STRING", "str", doc="the prompt text: echoed (echo_text) by non-streaming requests"),
    InputSpec(
        "request_id",
        "STRING",
        "str",
        doc="engine request id to use (unique among running requests); default: generated",
    ),
    InputSpec(
        "abort_request_id",
        "STRING",
        "str",
        doc="control request: abort the running request whose request_id output this is (input_ids may "
        "be empty); only ids the model generated, not ones a client chose",
    ),
)
ENGINE_OUTPUTS = {
    "output_ids": "INT32",  # the new token ids of this response
    "prefix_ids": "INT32",  # up to 5 ids just before them (prompt ids at the start): detokenization context
    "exit_depths": "INT32",  # the loop depth of each new token
    "output_log_probs": "FP32",  # with return_logprobs, the logprob of each new token (else empty)
    "trim_chars": "INT32",  # characters to drop from the end of this response's text (stop string)
    "num_input_tokens": "INT32",
    "num_output_tokens": "INT32",  # tokens in this response
    "finish_reason": "STRING",  # "" until the last response: stop | length | cancelled
    "num_spec_drafted_tokens": "INT32",  # self-speculation: the request's drafted tokens so far
    "num_spec_accepted_tokens": "INT32",  # ... and how many of them verification accepted
    "num_cached_tokens": "INT32",  # prompt tokens whose KV came from the prefix cache (0 before the first token)
    "echo_text": "STRING",  # text to put before this response's text: the prompt when echoed, else ""
    "return_num_input_tokens": "BOOL",  # the request's return_* flags, passed through
    "return_num_output_tokens": "BOOL",
    "return_finish_reason": "BOOL",
    "return_spec_counts": "BOOL",
    "return_num_cached_tokens": "BOOL",
    "return_logprobs": "BOOL",
}
# `ouro_engine` also returns each request's id: the `abort_request_id` that aborts it (engine_model.py).
ENGINE_ID_OUTPUT = {"request_id": "STRING"}
POST_INPUTS = _spec(
    InputSpec("output_ids", "INT32", "int", is_list=True),
    InputSpec("prefix_ids", "INT32", "int", is_list=True),
    InputSpec("trim_chars", "INT32", "int"),
    InputSpec("exit_depths", "INT32", "int", is_list=True),
    InputSpec("output_log_probs", "FP32", "float", is_list=True),
    InputSpec("num_input_tokens", "INT32", "int"),
    InputSpec("num_output_tokens", "INT32", "int"),
    InputSpec("finish_reason", "STRING", "str"),
    InputSpec("num_spec_drafted_tokens", "INT32", "int"),
    InputSpec("num_spec_accepted_tokens", "INT32", "int"),
    InputSpec("num_cached_tokens", "INT32", "int"),
    InputSpec("echo_text", "STRING", "str"),
    *RETURN_FLAGS.values(),
)
CLIENT_OUTPUTS = {
    "text_output": "STRING",
    "exit_depths": "INT32",
    "output_log_probs": "FP32",  # with return_logprobs
    "num_input_tokens": "INT32",
    "num_output_tokens": "INT32",
    "finish_reason": "STRING",
    "num_spec_drafted_tokens": "INT32",
    "num_spec_accepted_tokens": "INT32",
    "num_cached_tokens": "INT32",
}
MAX_STREAM_INTERVAL = 1 << 20
FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "cancelled", "cancelled": "cancelled"}

# Request parameters Triton or its clients set themselves; anything else in `request.parameters()` is a
# field the model does not know (for example an unknown JSON field of /generate) and is rejected.
RESERVED_PARAMETERS = frozenset(
    {
        "sequence_id",
        "sequence_start",
        "sequence_end",
        "priority",
        "timeout",
        "binary_data_output",
        "headers",
        "request_id",
        "id",
    }
)


class ParsedRequest:
    """A validated request: the prompt, the SamplingParams and the serving flags."""

    __slots__ = (
        "prompt",
        "params",
        "stream",
        "exclude_input_in_output",
        "return_num_input_tokens",
        "return_num_output_tokens",
        "return_finish_reason",
        "return_spec_counts",
        "return_num_cached_tokens",
        "return_logprobs",
        "request_id",
        "abort_request_id",
        "prompt_text",
        "stream_interval",
    )

    def __init__(
        self,
        prompt,
        params,
        stream=False,
        exclude_input_in_output=False,
        return_num_input_tokens=False,
        return_num_output_tokens=False,
        return_finish_reason=False,
        return_spec_counts=False,
        return_num_cached_tokens=False,
        return_logprobs=False,
        request_id=None,
        abort_request_id=None,
        prompt_text=None,
        stream_interval=None,
    ):
        self.prompt: str | list[int] | None = prompt
        self.params: SamplingParams | None = params
        self.stream = stream
        self.exclude_input_in_output = exclude_input_in_output
        self.return_num_input_tokens = return_num_input_tokens
        self.return_num_output_tokens = return_num_output_tokens
        self.return_finish_reason = return_finish_reason
        self.return_spec_counts = return_spec_counts
        self.return_num_cached_tokens = return_num_cached_tokens
        self.return_logprobs = return_logprobs
        self.request_id: str | None = request_id
        self.abort_request_id: str | None = abort_request_id
        # The prompt as text (client models; the engine when given text_input): what echo_text repeats.
        self.prompt_text: str | None = prompt if isinstance(prompt, str) else prompt_text
        self.stream_interval: int | None = stream_interval  # None: the server's default

    @property
    def return_flags(self) -> tuple[bool, ...]:
        """The RETURN_FLAGS, in order."""
        return tuple(getattr(self, name) for name in RETURN_FLAGS)

    @property
    def echo_prompt(self) -> bool:
        """Whether the one (non-streaming) response starts with the prompt text."""
        return not self.stream and not self.exclude_input_in_output

    def __repr__(self) -> str:
        return f"ParsedRequest(prompt={self.prompt!r}, params={self.params!r}, stream={self.stream})"


# ---------------------------------------------------------------------------------------------------------
# Reading arrays


def _values(name: str, arr: Any, spec: InputSpec) -> np.ndarray:
    """The flat values of one request's tensor, after checking batch size and dtype."""
    arr = np.asarray(arr)
    batched = arr.ndim >= 2 or (arr.ndim == 1 and not spec.is_list and arr.size != 1)  # [batch, ...]
    if batched and arr.shape[0] != 1:  # one prompt per request
        raise RequestError(
            f"input {name!r} has batch size {arr.shape[0]} (shape {list(arr.shape)}); "
            f"only batch size 1 is supported: send one prompt per request"
        )
    flat = arr.reshape(-1)
    kind = arr.dtype.kind
    ok = {
        "int": kind in "iu",
        "uint": kind in "iu",
        "float": kind in "fiu",
        "bool": kind == "b",
        "str": kind in "OSU",
    }[spec.kind]
    if not ok:
        raise RequestError(f"input {name!r} must be TYPE_{spec.triton_dtype}, got a {arr.dtype} tensor")
    if not spec.is_list and flat.size != 1:
        raise RequestError(f"input {name!r} must hold one value, got shape {list(arr.shape)}")
    return flat


def _to_str(name: str, v: Any) -> str:
    if isinstance(v, (bytes, np.bytes_)):
        try:
            return bytes(v).decode("utf-8")
        except UnicodeDecodeError:
            raise RequestError(f"input {name!r} is not valid UTF-8") from None
    if isinstance(v, str):
        return v
    raise RequestError(f"input {name!r} must be a string, got {type(v).__name__}")


def read_scalar(inputs: Mapping[str, Any], name: str, specs: Mapping[str, InputSpec], default=None):
    """The Python value of an optional scalar input (None/absent -> default)."""
    arr = inputs.get(name)
    if arr is None:
        return default
    spec = specs[name]
    v = _values(name, arr, spec)[0]
    if spec.kind in ("int", "uint"):
        v = int(v)
        if spec.kind == "uint" and v < 0:
            raise RequestError(f"input {name!r} must be non-negative, got {v}")
        return v
    if spec.kind == "float":
        v = float(v)
        if not math.isfinite(v):
            raise RequestError(f"input {name!r} must be a finite number, got {v}")
        return v
    if spec.kind == "bool":
        return bool(v)
    return _to_str(name, v)


def read_list(inputs: Mapping[str, Any], name: str, specs: Mapping[str, InputSpec]) -> list | None:
    arr = inputs.get(name)
    if arr is None:
        return None
    spec = specs[name]
    flat = _values(name, arr, spec)
    if spec.kind in ("int", "uint"):
        return [int(x) for x in flat]
    if spec.kind == "str":
        return [_to_str(name, x) for x in flat]
    return flat.tolist()


def check_known_inputs(inputs: Iterable[str], specs: Mapping[str, InputSpec], model: str = "") -> None:
    unknown = sorted(set(inputs) - set(specs))
    if unknown:
        where = f" for model {model!r}" if model else ""
        raise RequestError(f"unknown input(s){where}: {', '.join(unknown)}; known inputs: {', '.join(specs)}")


def timeout_parameter_us(parameters: str | Mapping[str, Any] | None) -> int:
    """The request's `timeout` parameter in microseconds (0: none). Triton 2.51 leaves a /generate JSON
    field `timeout` there instead of setting the request's own timeout."""
    if isinstance(parameters, str):
        try:
            parameters = json.loads(parameters) if parameters else {}
        except ValueError:
            return 0
    value = (parameters or {}).get("timeout", 0)
    if value == 0:
        return 0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise RequestError(f"timeout must be a positive number of microseconds, got {value!r}")
    return int(value)


def check_parameters(parameters: str | Mapping[str, Any] | None, model: str = "") -> None:
    """Reject request parameters the model does not know (e.g. an unknown JSON field of /generate, which
    Triton turns into a request parameter instead of an input)."""
    if not parameters:
        return
    if isinstance(parameters, str):
        try:
            parameters = json.loads(parameters)
        except ValueError:
            return
    unknown = sorted(
        k for k in parameters if k not in RESERVED_PARAMETERS and not k.startswith("triton_") and not k.startswith("_")
    )
    if unknown:
        where = f" of model {model!r}" if model else ""
        raise RequestError(
            f"unknown field(s) {', '.join(repr(k) for k in unknown)}: not an input{where}; "
            f"known inputs: {', '.join(CLIENT_INPUTS)}"
        )


# ---------------------------------------------------------------------------------------------------------
# Requests


def _sampling_json(raw: str | None) -> dict[str, Any]:
    """The `sampling_parameters` input (a JSON object, vLLM's names) -> {field: value}, `stop` as a list.
    RequestError naming the key for anything else: not JSON, not an object, an unknown or unsupported key,
    a value of the wrong JSON type."""
    if raw is None or raw.strip() == "":
        return {}
    try:
        obj = json.loads(raw)
    except ValueError as e:
        raise RequestError(f"sampling_parameters is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise RequestError(f"sampling_parameters must be a JSON object, got {type(obj).__name__}")
    out: dict[str, Any] = {}
    value: Any
    for key, value in obj.items():
        if key not in SAMPLING_JSON_KEYS:
            raise RequestError(
                f"sampling_parameters.{key} is not supported; supported: {', '.join(sorted(SAMPLING_JSON_KEYS))}"
            )
        if value is None:
            continue
        types = SAMPLING_JSON_KEYS[key]
        if isinstance(value, bool) and bool not in types or not isinstance(value, types):
            raise RequestError(
                f"sampling_parameters.{key} must be {' or '.join(t.__name__ for t in types)}, "
                f"got {type(value).__name__} {value!r}"
            )
        if key == "logprobs" and value != 0:
            raise RequestError(
                f"sampling_parameters.logprobs must be 0 (the sampled token's logprob, returned as "
                f"output_log_probs), got {value!r}: top-N alternatives are not returned"
            )
        if key in ("stop", "bad_words"):
            value = [value] if isinstance(value, str) else value
            if not all(isinstance(v, str) for v in value):
                raise RequestError(f"sampling_parameters.{key} must be a string or a list of strings")
        out[key] = float(value) if float in types and not isinstance(value, bool) else value
    return out


def parse_request(
    inputs: Mapping[str, Any],
    *,
    specs: Mapping[str, InputSpec] = CLIENT_INPUTS,
    prompt_input: str = "text_input",
    model: str = "",
) -> ParsedRequest:
    """Validate one request's tensors -> ParsedRequest. Raises RequestError naming the bad input.

    `prompt_input` is "text_input" (client models: a string prompt) or "input_ids" (the engine: token ids).
    """
    check_known_inputs(inputs, specs, model)
    abort_id = read_scalar(inputs, "abort_request_id", specs) if "abort_request_id" in specs else None
    if abort_id is not None:
        if not abort_id:
            raise RequestError("abort_request_id is empty")
        return ParsedRequest(None, None, abort_request_id=abort_id)

    if inputs.get(prompt_input) is None:
        raise RequestError(f"missing required input {prompt_input!r}")
    if prompt_input == "input_ids":
        prompt: str | list[int] = read_list(inputs, prompt_input, specs) or []
        if not prompt:
            raise RequestError("input_ids is empty")
    else:
        prompt = read_scalar(inputs, prompt_input, specs)
        if not prompt:
            raise RequestError(f"{prompt_input} is empty")

    def scalar(name, default=None):
        return read_scalar(inputs, name, specs, default) if name in specs else default

    given = _sampling_json(scalar("sampling_parameters"))
    for name, value in given.items():  # a field given as its own input too must agree
        if name == "logprobs":  # the same request as the input return_logprobs=true, which cannot disagree
            continue
        lists = {"stop": "stop_words", "bad_words": "bad_words"}  # JSON key -> its list input
        own = read_list(inputs, lists[name], specs) if name in lists else scalar(name)
        if own is not None and own != value and not (name in lists and not own):
            raise RequestError(f"sampling_parameters.{name} ({value!r}) and the input {name} ({own!r}) disagree")

    seed, random_seed = scalar("seed", given.get("seed")), scalar("random_seed")
    if seed is not None and random_seed is not None and seed != random_seed:
        raise RequestError(f"seed ({seed}) and random_seed ({random_seed}) disagree; send one of them")
    kwargs: dict[str, Any] = {}
    for name in (
        "max_tokens",
        "min_tokens",
        "temperature",
        "top_p",
        "top_k",
        "ignore_eos",
        "min_loops",
        "max_loops",
        "exit_threshold",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
    ):
        v = scalar(name, given.get(name))
        if v is not None:
            kwargs[name] = v
    if seed is not None or random_seed is not None:
        kwargs["seed"] = seed if seed is not None else random_seed
    stop = read_list(inputs, "stop_words", specs) if "stop_words" in specs else None
    stop = stop or given.get("stop")
    if stop:
        stop = [s for s in stop if s != ""]  # an empty entry is padding, not a stop string
        if stop:
            kwargs["stop"] = stop
    bad_words = read_list(inputs, "bad_words", specs) if "bad_words" in specs else None
    bad_words = [w for w in (bad_words or given.get("bad_words") or []) if w != ""]  # "": padding
    if bad_words:
        kwargs["bad_words"] = bad_words
    trace = read_list(inputs, "exit_trace", specs) if "exit_trace" in specs else None
    if trace:
        kwargs["exit_trace"] = trace
    return_logprobs = bool(scalar("return_logprobs", False)) or "logprobs" in given
    kwargs["logprobs"] = return_logprobs
    params = SamplingParams(**kwargs)  # validates: RequestError on bad values
    request_id = scalar("request_id")
    if request_id is not None and not request_id:
        raise RequestError("request_id is empty")
    prompt_text = scalar("text_input") if prompt_input != "text_input" else None
    interval = scalar("stream_interval")
    if interval is not None and not 0 <= interval <= MAX_STREAM_INTERVAL:
        raise RequestError(f"stream_interval must be in [0, {MAX_STREAM_INTERVAL}], got {interval}")
    return ParsedRequest(
        prompt,
        params,
        prompt_text=prompt_text,
        stream=bool(scalar("stream", False)),
        exclude_input_in_output=bool(scalar("exclude_input_in_output", False)),
        return_num_input_tokens=bool(scalar("return_num_input_tokens", False)),
        return_num_output_tokens=bool(scalar("return_num_output_tokens", False)),
        return_finish_reason=bool(scalar("return_finish_reason", False)),
        return_spec_counts=bool(scalar("return_spec_counts", False)),
        return_num_cached_tokens=bool(scalar("return_num_cached_tokens", False)),
        return_logprobs=return_logprobs,
        request_id=request_id,
        stream_interval=interval,
    )


# ---------------------------------------------------------------------------------------------------------
# Responses (batched shapes: [1, ...])


def _ints(values: Sequence[int]) -> np.ndarray:
    return np.asarray(list(values), dtype=np.int32).reshape(1, -1)


def _scalar_int(v: int) -> np.ndarray:
    return np.asarray([[v]], dtype=np.int32)


def string_array(s: str) -> np.ndarray:
    """A [1, 1] STRING tensor."""
    return np.asarray([[s.encode("utf-8")]], dtype=np.object_)


def finish_reason_name(reason: str | None) -> str:
    """The client-facing finish reason ("" while the stream goes on)."""
    if not reason:
        return ""
    return FINISH_REASONS.get(reason, reason)


def _check_return_flags(flags: Sequence[bool]) -> None:
    if len(flags) != len(RETURN_FLAGS):
        raise ValueError(f"{len(flags)} return flags for {len(RETURN_FLAGS)}: {', '.join(RETURN_FLAGS)}")


def _floats(values: Sequence[float]) -> np.ndarray:
    return np.asarray(list(values), dtype=np.float32).reshape(1, -1)


def engine_response_arrays(
    output_ids: Sequence[int],
    prefix_ids: Sequence[int],
    exit_depths: Sequence[int],
    trim_chars: int,
    num_input_tokens: int,
    finish_reason: str | None,
    echo_text: str = "",
    return_flags: Sequence[bool] = (False,) * len(RETURN_FLAGS),
    spec_counts: tuple[int, int] = (0, 0),
    num_cached_tokens: int = 0,
    log_probs: Sequence[float] = (),
) -> dict[str, np.ndarray]:
    """One `ouro_engine` response. `return_flags`: the request's RETURN_FLAGS, in order;
    `spec_counts`: the request's (drafted, accepted) speculative tokens so far; `num_cached_tokens`: its
    prompt tokens found in the prefix cache; `log_probs`: one per token with return_logprobs, else empty."""
    if len(exit_depths) != len(output_ids):
        raise ValueError(f"{len(output_ids)} tokens but {len(exit_depths)} exit depths")
    if log_probs and len(log_probs) != len(output_ids):
        raise ValueError(f"{len(output_ids)} tokens but {len(log_probs)} logprobs")
    _check_return_flags(return_flags)
    return {
        "output_ids": _ints(output_ids),
        "prefix_ids": _ints(prefix_ids),
        "exit_depths": _ints(exit_depths),
        "output_log_probs": _floats(log_probs),
        "trim_chars": _scalar_int(trim_chars),
        "num_input_tokens": _scalar_int(num_input_tokens),
        "num_output_tokens": _scalar_int(len(output_ids)),
        "finish_reason": string_array(finish_reason_name(finish_reason)),
        "num_spec_drafted_tokens": _scalar_int(spec_counts[0]),
        "num_spec_accepted_tokens": _scalar_int(spec_counts[1]),
        "num_cached_tokens": _scalar_int(num_cached_tokens),
        "echo_text": string_array(echo_text or ""),
        **{name: np.asarray([[bool(v)]], dtype=np.bool_) for name, v in zip(RETURN_FLAGS, return_flags)},
    }


def detokenize(
    tokenizer,
    output_ids: Sequence[int],
    prefix_ids: Sequence[int],
    trim_chars: int = 0,
    final: bool = False,
    prompt_text: str | None = None,
) -> str:
    """The text of one engine response: decode(prefix + new) - decode(prefix), holding back an incomplete
    trailing character unless `final`, minus `trim_chars` (a stop string), after `prompt_text` if echoed.

    Stateless, so any post-processing instance can handle any response of any stream; the concatenation of
    a stream's deltas equals the one-shot text of the same tokens."""
    from ..model.tokenizer import decode_delta

    text = decode_delta(tokenizer, list(prefix_ids), list(output_ids), final=final) if len(output_ids) else ""
    if trim_chars > 0:
        text = text[: max(0, len(text) - trim_chars)]
    if prompt_text:
        text = prompt_text + text
    return text


def client_response_arrays(
    tokenizer,
    output_ids: Sequence[int],
    prefix_ids: Sequence[int],
    exit_depths: Sequence[int],
    trim_chars: int,
    num_input_tokens: int,
    finish_reason: str | None,
    echo_text: str = "",
    return_flags: Sequence[bool] = (False,) * len(RETURN_FLAGS),
    spec_counts: tuple[int, int] = (0, 0),
    num_cached_tokens: int = 0,
    num_output_tokens: int | None = None,
    log_probs: Sequence[float] = (),
) -> dict[str, np.ndarray]:
    """One client-facing response from an engine response's fields (as `engine_response_arrays` takes
    them): the `ouro` front builds it directly, `postprocessing` from the engine's tensors."""
    _check_return_flags(return_flags)
    want = dict(zip(RETURN_FLAGS, return_flags))
    text = detokenize(tokenizer, output_ids, prefix_ids, trim_chars, final=bool(finish_reason), prompt_text=echo_text)
    out = {"text_output": string_array(text), "exit_depths": _ints(exit_depths)}
    if want["return_num_input_tokens"]:
        out["num_input_tokens"] = _scalar_int(num_input_tokens)
    if want["return_num_output_tokens"]:
        out["num_output_tokens"] = _scalar_int(len(output_ids) if num_output_tokens is None else num_output_tokens)
    if want["return_finish_reason"]:
        out["finish_reason"] = string_array(finish_reason_name(finish_reason))
    if want["return_spec_counts"]:
        out["num_spec_drafted_tokens"] = _scalar_int(spec_counts[0])
        out["num_spec_accepted_tokens"] = _scalar_int(spec_counts[1])
    if want["return_num_cached_tokens"]:
        out["num_cached_tokens"] = _scalar_int(num_cached_tokens)
    if want["return_logprobs"]:
        if len(log_probs) != len(output_ids):
            raise ValueError(f"{len(output_ids)} tokens but {len(log_probs)} logprobs")
        out["output_log_probs"] = _floats(log_probs)
    return out


def postprocess_arrays(tokenizer, inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """`postprocessing`: one engine response's tensors -> the client-facing tensors."""
    check_known_inputs(inputs, POST_INPUTS, "postprocessing")
    for name in ("output_ids", "prefix_ids"):
        if inputs.get(name) is None:
            raise RequestError(f"missing required input {name!r}")
    scalar = lambda name, default: read_scalar(inputs, name, POST_INPUTS, default)  # noqa: E731
    ids = read_list(inputs, "output_ids", POST_INPUTS)
    depths = read_list(inputs, "exit_depths", POST_INPUTS)
    log_probs = read_list(inputs, "output_log_probs", POST_INPUTS)
    prefix = read_list(inputs, "prefix_ids", POST_INPUTS)
    assert ids is not None and prefix is not None  # required: checked above
    return client_response_arrays(
        tokenizer,
        ids,
        prefix,
        depths if depths is not None else [],
        scalar("trim_chars", 0),
        scalar("num_input_tokens", 0),
        scalar("finish_reason", ""),
        echo_text=scalar("echo_text", ""),
        return_flags=tuple(bool(scalar(f, False)) for f in RETURN_FLAGS),
        spec_counts=(scalar("num_spec_drafted_tokens", 0), scalar("num_spec_accepted_tokens", 0)),
        num_cached_tokens=scalar("num_cached_tokens", 0),
        num_output_tokens=scalar("num_output_tokens", None),
        log_probs=log_probs or [],
    )


def prompt_byte_limit(tokenizer, context_tokens: int) -> int:
    """The most UTF-8 bytes a prompt that fits `context_tokens` tokens can have: no token stands for more
    than 4 bytes per character of the longest vocabulary entry."""
    longest = max((len(t) for t in tokenizer.get_vocab(with_added_tokens=True)), default=1)
    return context_tokens * 4 * longest


def check_prompt_bytes(inputs: Mapping[str, Any], name: str, limit: int, context_tokens: int) -> None:
    """Refuse a prompt too long to fit the context by its byte count alone, before it is decoded or
    tokenized (a multi-megabyte prompt would hold a stub for seconds and grow its memory)."""
    arr = inputs.get(name)
    if arr is None:
        return
    size = sum(len(v) for v in np.asarray(arr).reshape(-1) if isinstance(v, (bytes, str)))
    if size > limit:
        raise RequestError(
            f"{name} is {size} bytes: longer than any prompt that fits the {context_tokens}-token "
            f"context ({limit} bytes at most with this tokenizer)"
        )


def tokenize_arrays(tokenizer, text: str) -> dict[str, np.ndarray]:
    """`preprocessing`: the prompt's token ids (no special tokens added, as the engine does for text)."""
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    if not ids:
        raise RequestError("text_input tokenizes to no tokens")
    return {"input_ids": _ints(ids)}
