"""An OpenAI-compatible HTTP API in front of the `ouro` Triton model: `/v1/completions`,
`/v1/chat/completions` (streaming SSE and not), `/v1/models`, `/health`.

    python -m ouro_backend.entrypoints.openai_api --grpc-url 127.0.0.1:8001 --model DIR [--port 9000]

`ouro-serve --openai-port N` starts it next to tritonserver. Each request becomes one gRPC
ModelStreamInfer stream to `ouro` (`tritonclient.grpc.aio`), always streamed from Triton and joined here
for non-streaming answers; an HTTP client that disconnects mid-stream cancels the Triton request, which
aborts it in the engine and frees its KV.

Contract (docs: ouro_backend/serving/README.md, "OpenAI-compatible API"):
- `usage` comes from the server's own counts (`num_input_tokens`, `num_output_tokens`), not a re-tokenization.
- Each choice carries the extension field `exit_depths`: the loop depth of each of its tokens (in a stream
  chunk, those of the chunk's tokens).
- Ouro's `exit_threshold`, `min_loops`, `max_loops` and vLLM's `top_k`, `min_tokens`, `ignore_eos`,
  `repetition_penalty` are extra body fields (`extra_body` in the openai client).
- Unknown fields are ignored, as vLLM's server does. `n` > 1, `best_of` > 1, top-N logprobs and prompts of
  token ids are refused with 400.
- Errors are OpenAI error objects: `{"error": {"message", "type", "param", "code"}}`: 400 for a bad field
  (the model's own checks included, with its message), 404 for an unknown model, 503 when Triton is not
  ready.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import json
import logging
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..serving import protocol
from .tritonserver import ServerError, TritonServer, bind_error, parent_death_wrapper

log = logging.getLogger(__name__)

TRITON_MODEL = "ouro"
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context

# Body field -> the `ouro` input it becomes, and the JSON types it takes (bool is not a number here).
NUMBER, INTEGER, BOOLEAN = (int, float), (int,), (bool,)
PASS_THROUGH: dict[str, tuple[str, tuple[type, ...]]] = {
    "temperature": ("temperature", NUMBER),
    "top_p": ("top_p", NUMBER),
    "top_k": ("top_k", INTEGER),
    "seed": ("seed", INTEGER),
    "min_tokens": ("min_tokens", INTEGER),
    "ignore_eos": ("ignore_eos", BOOLEAN),
    "presence_penalty": ("presence_penalty", NUMBER),
    "frequency_penalty": ("frequency_penalty", NUMBER),
    "repetition_penalty": ("repetition_penalty", NUMBER),
    "exit_threshold": ("exit_threshold", NUMBER),
    "min_loops": ("min_loops", INTEGER),
    "max_loops": ("max_loops", INTEGER),
}
TYPE_NAMES = {int: "integer", float: "number", bool: "boolean", str: "string", list: "array", dict: "object"}
NUMPY_OF = {"INT64": np.int64, "UINT64": np.uint64, "FP32": np.float32, "BOOL": np.bool_}


class APIError(Exception):
    """An OpenAI error object with its HTTP status."""

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


def _typed(body: dict[str, Any], name: str, types: tuple[type, ...]) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) and bool not in types or not isinstance(value, types):
        want = " or ".join(
            {int: "integer", float: "number", bool: "boolean", str: "string", list: "array"}[t] for t in types
        )
        raise APIError(f"{name} must be {'an' if want[0] in 'aeiou' else 'a'} {want}, not {json.dumps(value)}", name)
    return value


@dataclass
class GenerationRequest:
    """What one OpenAI request asks of `ouro`."""

    prompt: str
    inputs: dict[str, Any]  # `ouro` input name -> value
    stream: bool
    include_usage: bool = False
    echo: bool = False
    logprobs: bool = False


def parse_common(body: dict[str, Any], prompt: str, max_tokens: int | None, available: set[str]) -> GenerationRequest:
    """The fields completions and chat share; `available` is the `ouro` model's input names."""
    if _typed(body, "n", INTEGER) not in (None, 1):
        raise APIError("n must be 1: one choice per request", "n")
    stream = bool(_typed(body, "stream", BOOLEAN))
    opts = _typed(body, "stream_options", (dict,)) or {}
    if opts and not stream:
        raise APIError("stream_options is only allowed with stream: true", "stream_options")
    inputs: dict[str, Any] = {"max_tokens": max_tokens}
    if max_tokens is not None and max_tokens < 1:
        raise APIError(f"max_tokens must be at least 1, not {max_tokens}", "max_tokens")
    for name, (triton_name, types) in PASS_THROUGH.items():
        value = _typed(body, name, types)
        if value is None:
            continue
        if triton_name not in available:
            raise APIError(f"{name} is not supported by this server's model", name)
        inputs[triton_name] = value
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise APIError("stop must be a non-empty string or an array of them", "stop")
        if stop:
            inputs["stop_words"] = stop
    return GenerationRequest(prompt, inputs, stream, include_usage=bool(opts.get("include_usage")))


def parse_completion(body: dict[str, Any], available: set[str]) -> GenerationRequest:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise APIError("prompt must be a string or an array of one string (token ids are not supported)", "prompt")
    if _typed(body, "best_of", INTEGER) not in (None, 1):
        raise APIError("best_of must be 1", "best_of")
    if body.get("suffix") is not None:
        raise APIError("suffix is not supported", "suffix")
    max_tokens = _typed(body, "max_tokens", INTEGER)
    req = parse_common(body, prompt, COMPLETION_MAX_TOKENS if max_tokens is None else max_tokens, available)
    req.echo = bool(_typed(body, "echo", BOOLEAN))
    logprobs = _typed(body, "logprobs", INTEGER)
    if logprobs not in (None, 0):
        raise APIError("logprobs must be 0: only the sampled token's logprob is available, no top-N", "logprobs")
    req.logprobs = logprobs == 0
    return req


def parse_chat(body: dict[str, Any], template: ChatTemplate | None, available: set[str]) -> GenerationRequest:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError("messages must be a non-empty array", "messages")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise APIError(f"messages[{i}] must be an object with a string role and string content", "messages")
    if template is None:
        raise APIError("this model has no chat template (tokenizer_config.json chat_template): use /v1/completions")
    max_tokens = _typed(body, "max_completion_tokens", INTEGER)
    if max_tokens is None:
        max_tokens = _typed(body, "max_tokens", INTEGER)
    req = parse_common(body, template.render(messages), max_tokens, available)
    if _typed(body, "top_logprobs", INTEGER) not in (None, 0):
        raise APIError("top_logprobs must be 0: only the sampled token's logprob is available", "top_logprobs")
    req.logprobs = bool(_typed(body, "logprobs", BOOLEAN))
    return req


class ChatTemplate:
    """The HF `chat_template` of a checkpoint's tokenizer_config.json, rendered in a sandboxed jinja2
    environment as transformers does (`messages`, `add_generation_prompt`, `bos_token`, `eos_token`)."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self.template = env.from_string(source)
        self.bos_token, self.eos_token = bos_token, eos_token

    @classmethod
    def of(cls, model_dir: str | Path) -> ChatTemplate | None:
        path = Path(model_dir) / "tokenizer_config.json"
        if not path.is_file():
            return None
        cfg = json.loads(path.read_text())
        source = cfg.get("chat_template")
        if not isinstance(source, str):
            return None

        def token(key: str) -> str:
            t = cfg.get(key) or ""
            return t.get("content", "") if isinstance(t, dict) else t

        return cls(source, token("bos_token"), token("eos_token"))

    def render(self, messages: list[dict[str, str]]) -> str:
        return self.template.render(
            messages=messages, add_generation_prompt=True, bos_token=self.bos_token, eos_token=self.eos_token
        )


class ContextLimit:
    """The checkpoint's context length and tokenizer: how many tokens a prompt leaves for the answer."""

    def __init__(self, model_dir: str | Path):
        from tokenizers import Tokenizer

        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        self.max_len = int(cfg["max_position_embeddings"])
        self.tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))

    def left(self, prompt: str) -> int:
        n = len(self.tokenizer.encode(prompt, add_special_tokens=False).ids)
        if n >= self.max_len:
            raise APIError(f"the prompt is {n} tokens: the model's context is {self.max_len}", "messages")
        return self.max_len - n


@dataclass
class Piece:
    """One `ouro` response: new text, its tokens' depths and logprobs, and the counts and end it reports."""

    text: str
    depths: list[int]
    logprobs: list[float]
    num_output_tokens: int
    num_input_tokens: int | None
    finish_reason: str | None


@dataclass
class Totals:
    text: list[str] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tokens: list[str] = field(default_factory=list)  # with logprobs: one response per token, so its text
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None

    def add(self, p: Piece) -> None:
        self.text.append(p.text)
        self.depths += p.depths
        self.logprobs += p.logprobs
        if p.logprobs:
            self.tokens.append(p.text)
        self.completion_tokens += p.num_output_tokens
        if p.num_input_tokens is not None:
            self.prompt_tokens = p.num_input_tokens
        if p.finish_reason:
            self.finish_reason = "length" if p.finish_reason == "length" else "stop"

    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


class TritonBackend:
    """Streams requests to the `ouro` model over gRPC (one ModelStreamInfer stream per request)."""

    def __init__(self, url: str):
        import tritonclient.grpc.aio as grpcclient

        self.tc = grpcclient
        self.client = grpcclient.InferenceServerClient(url)
        self._inputs: set[str] | None = None
        self._outputs: set[str] = set()

    async def ready(self) -> bool:
        try:
            return bool(await self.client.is_server_ready()) and bool(await self.client.is_model_ready(TRITON_MODEL))
        except Exception:
            return False

    async def inputs(self) -> set[str]:
        """The `ouro` model's input names (from its config, asked once it answers)."""
        if self._inputs is None:
            try:
                cfg = await self.client.get_model_config(TRITON_MODEL, as_json=True)
            except Exception as e:
                raise APIError(f"the {TRITON_MODEL} model is not ready: {e}", status=503) from e
            self._outputs = {o["name"] for o in cfg["config"]["output"]}
            self._inputs = {i["name"] for i in cfg["config"]["input"]}
        return self._inputs

    def _infer_inputs(self, req: GenerationRequest) -> list:
        values: dict[str, Any] = {
            "text_input": req.prompt,
            "stream": True,
            "return_num_input_tokens": True,
            "return_num_output_tokens": True,
            "return_finish_reason": True,
            **{k: v for k, v in req.inputs.items() if v is not None},
        }
        if req.logprobs:
            if "output_log_probs" not in self._outputs:
                raise APIError("logprobs are not supported by this server's model", "logprobs")
            values.update(return_logprobs=True, stream_interval=1)  # one token per response: its text is the token's
        out = []
        for name, value in values.items():
            spec = protocol.CLIENT_INPUTS[name]
            if spec.triton_dtype == "STRING":
                words = value if isinstance(value, list) else [value]
                arr = np.array([[w.encode("utf-8") for w in words]], dtype=np.object_)
                t = self.tc.InferInput(name, list(arr.shape), "BYTES")
            else:
                arr = np.array([[value]], dtype=NUMPY_OF[spec.triton_dtype])
                t = self.tc.InferInput(name, [1, 1], spec.triton_dtype)
            t.set_data_from_numpy(arr)
            out.append(t)
        return out

    async def generate(self, req: GenerationRequest) -> AsyncIterator[Piece]:
        """The request's responses until its final one. Closing the iterator early (a disconnected client)
        cancels the Triton request. A model error raises APIError (400) with the model's message."""
        await self.inputs()
        done = asyncio.Event()
        request = {
            "model_name": TRITON_MODEL,
            "inputs": self._infer_inputs(req),
            "request_id": uuid.uuid4().hex,
            "enable_empty_final_response": True,
        }

        async def requests():
            yield request
            await done.wait()  # the stream stays open until the final response

        it = self.client.stream_infer(requests())
        try:
            async for result, error in it:
                if error is not None:
                    raise APIError(_model_message(error))
                final = result.get_response().parameters.get("triton_final_response")
                piece = _piece(result)
                if piece is not None:
                    yield piece
                if final is not None and final.bool_param:
                    return
            raise APIError("the server closed the stream before the request finished", status=503)
        finally:
            done.set()
            it.cancel()


def _model_message(error: Exception) -> str:
    msg = error.message() if callable(getattr(error, "message", None)) else str(error)
    return str(msg)


def _piece(result) -> Piece | None:
    def arr(name: str):
        try:
            return result.as_numpy(name)
        except Exception:
            return None

    text = arr("text_output")
    if text is None:
        return None  # the empty final response
    depths = arr("exit_depths")
    lps = arr("output_log_probs")
    n_out, n_in, reason = arr("num_output_tokens"), arr("num_input_tokens"), arr("finish_reason")
    r = reason.reshape(-1)[0].decode() if reason is not None else ""
    return Piece(
        text.reshape(-1)[0].decode("utf-8"),
        [int(d) for d in depths.reshape(-1)] if depths is not None else [],
        [float(x) for x in lps.reshape(-1)] if lps is not None else [],
        int(n_out.reshape(-1)[0]) if n_out is not None else 0,
        int(n_in.reshape(-1)[0]) if n_in is not None else None,
        r or None,
    )


def create_app(grpc_url: str, model_dir: str, served_model_name: str = TRITON_MODEL) -> FastAPI:
    app = FastAPI(title="ouro-triton OpenAI-compatible API")
    backends: list[TritonBackend] = []  # made in the server's event loop (a grpc.aio channel belongs to one)

    def triton() -> TritonBackend:
        if not backends:
            backends.append(TritonBackend(grpc_url))
        return backends[0]

    template = ChatTemplate.of(model_dir)
    context = ContextLimit(model_dir)
    created = int(time.time())

    def error(e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    async def body_of(request: Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(f"the body is not valid JSON: {e}") from e
        if not isinstance(body, dict):
            raise APIError("the body must be a JSON object")
        model = body.get("model")
        if model != served_model_name:
            raise APIError(f"The model `{model}` does not exist.", "model", status=404, code="model_not_found")
        return body

    @app.get("/health")
    async def health():
        ok = await triton().ready()
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models():
        card = {"id": served_model_name, "object": "model", "created": created, "owned_by": "ouro-triton"}
        return {"object": "list", "data": [card]}

    async def serve(request: Request, chat: bool):
        try:
            body = await body_of(request)
            backend = triton()
            available = await backend.inputs()
            req = parse_chat(body, template, available) if chat else parse_completion(body, available)
            if req.inputs["max_tokens"] is None:  # chat without max_tokens: the rest of the context, as vLLM
                req.inputs["max_tokens"] = context.left(req.prompt)
            pieces = backend.generate(req)
            first = await anext(pieces, None)  # the model's own refusals become a 400 before any byte is sent
        except APIError as e:
            return error(e)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        shape = Shape(rid, served_model_name, int(time.time()), chat, req)
        if not req.stream:
            totals = Totals()
            try:
                if first is not None:
                    totals.add(first)
                async for p in pieces:
                    totals.add(p)
            except APIError as e:
                return error(e)
            return shape.whole(totals)

        async def events() -> AsyncIterator[str]:
            totals = Totals()
            try:
                if chat:
                    yield shape.sse(shape.chat_start())
                if req.echo:
                    yield shape.sse(shape.chunk(Piece(req.prompt, [], [], 0, None, None)))
                if first is not None:
                    totals.add(first)
                    yield shape.sse(shape.chunk(first))
                async for p in pieces:
                    totals.add(p)
                    yield shape.sse(shape.chunk(p))
                if req.include_usage:
                    yield shape.sse(shape.usage_chunk(totals))
            except APIError as e:
                yield shape.sse(e.body())
            finally:
                await pieces.aclose()  # a disconnected client lands here too: the Triton request is cancelled
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serve(request, chat=True)

    return app


@dataclass
class Shape:
    """The OpenAI objects of one request."""

    rid: str
    model: str
    created: int
    chat: bool
    req: GenerationRequest

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.rid, "object": kind, "created": self.created, "model": self.model}

    def _logprobs(self, tokens: list[str], lps: list[float]) -> dict[str, Any] | None:
        if not self.req.logprobs:
            return None
        if self.chat:
            return {
                "content": [
                    {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                    for t, lp in zip(tokens, lps)
                ]
            }
        offsets, at = [], len(self.req.prompt) if self.req.echo else 0
        for t in tokens:
            offsets.append(at)
            at += len(t)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": None, "text_offset": offsets}

    def whole(self, t: Totals) -> dict[str, Any]:
        text = "".join(t.text)
        choice: dict[str, Any] = {"index": 0, "finish_reason": t.finish_reason, "exit_depths": t.depths}
        choice["logprobs"] = self._logprobs(t.tokens, t.logprobs)
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = (self.req.prompt if self.req.echo else "") + text
        return {
            **self._head("chat.completion" if self.chat else "text_completion"),
            "choices": [choice],
            "usage": t.usage(),
        }

    def chunk(self, p: Piece) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": _reason(p.finish_reason), "exit_depths": p.depths}
        choice["logprobs"] = self._logprobs([p.text] if p.logprobs else [], p.logprobs)
        if self.chat:
            choice["delta"] = {"content": p.text}
        else:
            choice["text"] = p.text
        head = self._head("chat.completion.chunk" if self.chat else "text_completion")
        return {**head, "choices": [choice]}

    def chat_start(self) -> dict[str, Any]:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None, "logprobs": None}
        return {**self._head("chat.completion.chunk"), "choices": [choice]}

    def usage_chunk(self, t: Totals) -> dict[str, Any]:
        return {
            **self._head("chat.completion.chunk" if self.chat else "text_completion"),
            "choices": [],
            "usage": t.usage(),
        }

    @staticmethod
    def sse(obj: dict[str, Any]) -> str:
        return f"data: {json.dumps(obj)}\n\n"


def _reason(r: str | None) -> str | None:
    return None if not r else ("length" if r == "length" else "stop")


# ---- as a child process of ouro-serve ----
def check_openai_port(server: TritonServer, port: int) -> None:
    """ServerError if the API could not listen on `port`: one of tritonserver's ports, or in use."""
    for _, option, p in server.endpoints():
        if p == port:
            raise ServerError(f"--openai-port {port}: the same port as {option}; give each endpoint its own port")
    error = bind_error(server.bind_address, port)
    if error is None:
        return
    if error.errno == errno.EADDRINUSE:
        raise ServerError(server._port_in_use("OpenAI API", "--openai-port", port))
    raise ServerError(f"cannot listen on OpenAI API port {port} on {server.bind_address}: {error}")


class OpenAIServer:
    """The API in a process of its own, started with ouro-serve and kept across tritonserver restarts (it
    asks the gRPC port per request). It gets SIGTERM when ouro-serve stops, and when ouro-serve dies (setpriv
    --pdeathsig, where util-linux has it). Its log: the server log's path + `.openai-api`."""

    def __init__(self, server: TritonServer, address: str, port: int, timeout_s: float = 60.0):
        self.url = f"{server.host}:{port}"
        self.log_file = f"{server.log_file}.openai-api"
        cmd = [
            *parent_death_wrapper(),
            sys.executable,
            "-m",
            "ouro_backend.entrypoints.openai_api",
            "--grpc-url",
            server.grpc_url,
            "--model",
            server.model,
            "--host",
            address,
            "--port",
            str(port),
        ]
        with open(self.log_file, "ab") as log_handle:
            self.proc = subprocess.Popen(cmd, stdout=log_handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while not self._answers(server.host, port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = Path(self.log_file).read_text(errors="replace")[-2000:]
                raise ServerError(f"the OpenAI API did not start (log {self.log_file}):\n{tail}")
            time.sleep(0.1)

    @staticmethod
    def _answers(host: str, port: int) -> bool:
        try:
            with socket.create_connection((host, port), timeout=1):
                return True
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m ouro_backend.entrypoints.openai_api", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--grpc-url", default="127.0.0.1:8001", help="the tritonserver's gRPC endpoint")
    p.add_argument("--model", required=True, help="the served checkpoint (for its tokenizer_config.json chat template)")
    p.add_argument("--served-model-name", default=TRITON_MODEL, help="the `model` clients name (default: ouro)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=9000)
    p.add_argument("--log-level", default="warning")
    args = p.parse_args(argv)
    import uvicorn

    app = create_app(args.grpc_url, args.model, args.served_model_name)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
