"""The OpenAI API's request fields and response objects, for the `ouro` model (entrypoints/openai_api.py
serves them). Pure: no FastAPI, no Triton, so every rule here is unit-tested alone.

Requests: `parse_completion` / `parse_chat` check a JSON body and say what to ask of `ouro`
(`GenerationRequest`: its inputs, by the names of `protocol.CLIENT_INPUTS`). Every refusal is an `APIError`
naming the field (`param`), sent as the OpenAI error object `{"error": {"message", "type", "param",
"code"}}`. Fields no rule here names are ignored, as vLLM's server does.

Responses: `Piece` is one `ouro` response; `Totals` joins them; `Shape` makes the OpenAI objects (whole
answers, stream chunks, the usage chunk). Every choice carries the extension field `exit_depths`: the
loop depth of each of its tokens (of the chunk's tokens in a stream chunk).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from ..serving import protocol
from .chat_template import ChatTemplate, TemplateError

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat's is the rest of the context
INT64 = (-(1 << 63), (1 << 63) - 1)
UINT64 = (0, (1 << 64) - 1)

NUMBER, INTEGER, BOOLEAN = (int, float), (int,), (bool,)
# Body fields passed to the `ouro` input of the same name, and the JSON types each takes; an integer's range
# is its input's dtype in the tensor table (`bounds_of`).
PASS_THROUGH: dict[str, tuple[type, ...]] = {
    "temperature": NUMBER,
    "top_p": NUMBER,
    "top_k": INTEGER,
    "seed": INTEGER,
    "min_tokens": INTEGER,
    "ignore_eos": BOOLEAN,
    "presence_penalty": NUMBER,
    "frequency_penalty": NUMBER,
    "repetition_penalty": NUMBER,
    "exit_threshold": NUMBER,
    "min_loops": INTEGER,
    "max_loops": INTEGER,
}


def bounds_of(name: str) -> tuple[int, int]:
    """The integers the `ouro` input `name` holds (protocol.CLIENT_INPUTS' dtype)."""
    return UINT64 if protocol.CLIENT_INPUTS[name].triton_dtype == "UINT64" else INT64


TYPE_NAMES = {int: "integer", float: "number", bool: "boolean", str: "string", list: "array", dict: "object"}
# OpenAI fields whose meaning a client relies on and this server cannot give: refused, not ignored (each
# with the value that asks for nothing, which is accepted).
UNSUPPORTED: dict[str, Any] = {
    "suffix": None,
    "logit_bias": {},
    "tools": [],
    "functions": [],
    "response_format": {"type": "text"},
}


class APIError(Exception):
    """An OpenAI error object with its HTTP status: 400 for a bad field, 404 for an unknown model, 503 while
    the `ouro` model does not answer."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code

    def body(self) -> dict[str, Any]:
        kind = {400: "invalid_request_error", 404: "invalid_request_error", 503: "service_unavailable"}
        return {
            "error": {
                "message": self.message,
                "type": kind.get(self.status, "server_error"),
                "param": self.param,
                "code": self.code,
            }
        }


@dataclass(frozen=True)
class ModelInfo:
    """The `ouro` model's input and output names (its Triton config): what this server may ask of it."""

    inputs: frozenset[str]
    outputs: frozenset[str]

    @property
    def logprobs(self) -> bool:
        return "return_logprobs" in self.inputs and "output_log_probs" in self.outputs


def typed(body: dict[str, Any], name: str, types: tuple[type, ...], bounds: tuple[int, int] = INT64) -> Any:
    """body[name] (None when absent or null) after checking its JSON type, that a number is finite and that
    an integer lies in `bounds`. A bool is no number here."""
    value = body.get(name)
    if value is None:
        return None
    if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
        want = " or ".join(TYPE_NAMES[t] for t in types if not (t is int and float in types))
        raise APIError(f"{name} must be {'an' if want[0] in 'aeiou' else 'a'} {want}, not {json.dumps(value)}", name)
    if isinstance(value, float) and not math.isfinite(value):
        raise APIError(f"{name} must be a finite number, not {value}", name)
    if isinstance(value, int) and not isinstance(value, bool) and not bounds[0] <= value <= bounds[1]:
        raise APIError(f"{name} must be in [{bounds[0]}, {bounds[1]}], not {value}", name)
    return value


@dataclass
class GenerationRequest:
    """What one OpenAI request asks of `ouro`. `inputs` maps `ouro` input names to values; max_tokens is
    None for a chat request that leaves it to the server (the rest of the context)."""

    prompt: str
    inputs: dict[str, Any]
    stream: bool
    include_usage: bool = False
    echo: bool = False
    logprobs: bool = False


def _common(body: dict[str, Any], prompt: str, max_tokens: int | None, model: ModelInfo) -> GenerationRequest:
    """The fields completions and chat share."""
    for name, nothing in UNSUPPORTED.items():
        if body.get(name) not in (None, nothing):
            raise APIError(f"{name} is not supported by this server", name)
    if typed(body, "n", INTEGER) not in (None, 1):
        raise APIError("n must be 1: this server makes one choice per request", "n")
    stream = bool(typed(body, "stream", BOOLEAN))
    options = typed(body, "stream_options", (dict,))
    if options is not None and not stream:
        raise APIError("stream_options is only allowed with stream: true", "stream_options")
    include_usage = bool(typed(options or {}, "include_usage", BOOLEAN))
    if max_tokens is not None and max_tokens < 1:
        raise APIError(f"max_tokens must be at least 1, not {max_tokens}", "max_tokens")
    inputs: dict[str, Any] = {"max_tokens": max_tokens}
    for name, types in PASS_THROUGH.items():
        value = typed(body, name, types, bounds_of(name))
        if value is None:
            continue
        if name not in model.inputs:
            raise APIError(f"{name} is not supported by this server's model", name)
        inputs[name] = value
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
        raise APIError("stop must be a non-empty string or an array of them", "stop")
    if stop:
        inputs["stop_words"] = stop
    return GenerationRequest(prompt, inputs, stream, include_usage=include_usage)


def _want_logprobs(req: GenerationRequest, model: ModelInfo, param: str) -> None:
    if not model.logprobs:
        raise APIError(
            f"{param}: this server's `ouro` model cannot return logprobs (it has no output_log_probs output)", param
        )
    req.logprobs = True


def parse_completion(body: dict[str, Any], model: ModelInfo) -> GenerationRequest:
    """A /v1/completions body. `prompt`: a string or an array of one string; `logprobs` 0 or 1 (the sampled
    token's logprob; no alternatives); `echo`; `best_of` 1 only."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise APIError("prompt must be a string or an array of one string (token ids are not supported)", "prompt")
    if typed(body, "best_of", INTEGER) not in (None, 1):
        raise APIError("best_of must be 1: this server makes one choice per request", "best_of")
    max_tokens = typed(body, "max_tokens", INTEGER)
    req = _common(body, prompt, COMPLETION_MAX_TOKENS if max_tokens is None else max_tokens, model)
    req.echo = bool(typed(body, "echo", BOOLEAN))
    logprobs = typed(body, "logprobs", INTEGER)
    if logprobs is not None:
        if logprobs not in (0, 1):
            raise APIError(
                f"logprobs must be 0 or 1, not {logprobs}: only the sampled token's logprob is available", "logprobs"
            )
        _want_logprobs(req, model, "logprobs")
    return req


def message_text(i: int, message: Any) -> dict[str, Any]:
    """messages[i] with its content as one string (an array of text parts is joined, as vLLM does)."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise APIError(f"messages[{i}] must be an object with a string role", "messages")
    content = message.get("content")
    if isinstance(content, list):
        texts = [p.get("text") if isinstance(p, dict) and p.get("type") == "text" else None for p in content]
        if not all(isinstance(t, str) for t in texts):
            raise APIError(f"messages[{i}].content: only text parts are supported", "messages")
        content = "".join(str(t) for t in texts)
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise APIError(f"messages[{i}].content must be a string or an array of text parts", "messages")
    return {**message, "content": content}


def parse_chat(body: dict[str, Any], template: ChatTemplate | None, model: ModelInfo) -> GenerationRequest:
    """A /v1/chat/completions body: `messages` rendered with the checkpoint's template; `max_completion_tokens`
    (else `max_tokens`, else None: the rest of the context); `logprobs` true with `top_logprobs` 0."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError("messages must be a non-empty array", "messages")
    messages = [message_text(i, m) for i, m in enumerate(messages)]
    if template is None:
        raise APIError(
            "this model has no chat template (no chat_template in its tokenizer_config.json): "
            "use /v1/completions with a prompt of your own",
            "messages",
        )
    try:
        prompt = template.render(messages)
    except TemplateError as e:
        raise APIError(str(e), "messages") from e
    max_tokens = typed(body, "max_completion_tokens", INTEGER)
    if max_tokens is None:
        max_tokens = typed(body, "max_tokens", INTEGER)
    req = _common(body, prompt, max_tokens, model)
    top = typed(body, "top_logprobs", INTEGER)
    if top not in (None, 0):
        raise APIError(
            f"top_logprobs must be 0, not {top}: only the sampled token's logprob is available", "top_logprobs"
        )
    if typed(body, "logprobs", BOOLEAN):
        _want_logprobs(req, model, "logprobs")
    return req


# ---------------------------------------------------------------------------------------------------------
# Responses


def finish_reason(reason: str | None) -> str | None:
    """OpenAI's name for the model's finish_reason: `length`, else `stop` (EOS, a stop string); None before
    the end."""
    return None if not reason else ("length" if reason == "length" else "stop")


@dataclass
class Piece:
    """One `ouro` response: new text, its tokens' depths and logprobs, the tokens it counts, and (the last
    response) its finish_reason."""

    text: str
    depths: list[int]
    logprobs: list[float]
    num_output_tokens: int
    num_input_tokens: int | None
    finish_reason: str | None

    def tokens(self) -> list[str]:
        """The text of each token with a logprob: logprob requests get one token per response, so the text
        is that token's (a response that holds more puts its text on the first)."""
        return [self.text] + [""] * (len(self.logprobs) - 1) if self.logprobs else []


@dataclass
class Totals:
    """A request's pieces joined."""

    text: list[str] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tokens: list[str] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None

    def add(self, p: Piece) -> None:
        self.text.append(p.text)
        self.depths += p.depths
        self.logprobs += p.logprobs
        self.tokens += p.tokens()
        self.completion_tokens += p.num_output_tokens
        if p.num_input_tokens is not None:
            self.prompt_tokens = p.num_input_tokens
        self.finish_reason = finish_reason(p.finish_reason) or self.finish_reason

    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


@dataclass
class Shape:
    """The OpenAI objects of one request (`rid`: its id; `model`: the served name)."""

    rid: str
    model: str
    created: int
    chat: bool
    req: GenerationRequest
    offset: int = 0  # completions with logprobs: the text_offset of the next token

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.rid, "object": kind, "created": self.created, "model": self.model}

    def _logprobs(self, tokens: list[str], lps: list[float]) -> dict[str, Any] | None:
        if not self.req.logprobs:
            return None
        if self.chat:
            content = [
                {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []} for t, lp in zip(tokens, lps)
            ]
            return {"content": content}
        offsets = []
        for t in tokens:
            offsets.append(self.offset)
            self.offset += len(t)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": None, "text_offset": offsets}

    def _start(self) -> None:
        """Before the first token: text offsets count from the end of the echoed prompt."""
        self.offset = len(self.req.prompt) if self.req.echo and not self.chat else 0

    def whole(self, t: Totals) -> dict[str, Any]:
        """The non-streaming answer."""
        self._start()
        choice: dict[str, Any] = {"index": 0, "finish_reason": t.finish_reason, "exit_depths": t.depths}
        choice["logprobs"] = self._logprobs(t.tokens, t.logprobs)
        text = "".join(t.text)
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = (self.req.prompt if self.req.echo else "") + text
        kind = "chat.completion" if self.chat else "text_completion"
        return {**self._head(kind), "choices": [choice], "usage": t.usage()}

    def first_chunks(self) -> list[dict[str, Any]]:
        """What a stream sends before its first piece: chat's assistant role, or the echoed prompt."""
        self._start()
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "delta": {"role": "assistant", "content": ""}}
        elif self.req.echo:
            choice = {"index": 0, "text": self.req.prompt, "exit_depths": []}
        else:
            return []
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return [{**self._head(kind), "choices": [{**choice, "finish_reason": None, "logprobs": None}]}]

    def chunk(self, p: Piece) -> dict[str, Any]:
        """The stream chunk of one piece."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason(p.finish_reason), "exit_depths": p.depths}
        choice["logprobs"] = self._logprobs(p.tokens(), p.logprobs)
        if self.chat:
            choice["delta"] = {"content": p.text}
        else:
            choice["text"] = p.text
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [choice]}

    def usage_chunk(self, t: Totals) -> dict[str, Any]:
        """stream_options.include_usage: the last chunk, with no choices."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(kind), "choices": [], "usage": t.usage()}


def sse(obj: dict[str, Any]) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(obj)}\n\n"
