"""An OpenAI-compatible HTTP API in front of the `ouro` Triton model: `/v1/completions`,
`/v1/chat/completions` (streaming SSE and not), `/v1/models`, `/health`.

    python -m ouro_backend.entrypoints.openai_api --grpc-url 127.0.0.1:8001 --model DIR [--port 9000]

`ouro-serve --openai-port N` runs it as a child process (openai_process.py). Each request becomes one gRPC
ModelStreamInfer stream to `ouro` (`tritonclient.grpc.aio`), always streamed from Triton and joined here for
a non-streaming answer. An HTTP client that goes away (mid-stream, or while waiting for a whole answer)
cancels its Triton request, which aborts it in the engine and frees its KV.

The fields, the extension field `exit_depths` and the errors are those of `openai_protocol.py`
(docs: ouro_backend/serving/README.md, "OpenAI-compatible API").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..serving import protocol
from .chat_template import ChatTemplate, TemplateError
from .openai_protocol import (
    APIError,
    GenerationRequest,
    ModelInfo,
    Piece,
    Shape,
    Totals,
    parse_chat,
    parse_completion,
    sse,
)

TRITON_MODEL = "ouro"
NUMPY_OF = {"INT64": np.int64, "UINT64": np.uint64, "FP32": np.float32, "BOOL": np.bool_}


class TritonBackend:
    """Streams requests to the `ouro` model over gRPC, one ModelStreamInfer stream per request. Made inside
    the server's event loop (a grpc.aio channel belongs to one)."""

    def __init__(self, url: str):
        import tritonclient.grpc.aio as grpcclient

        self.tc = grpcclient
        self.client = grpcclient.InferenceServerClient(url)
        self._info: ModelInfo | None = None

    async def ready(self) -> bool:
        try:
            return bool(await self.client.is_server_ready()) and bool(await self.client.is_model_ready(TRITON_MODEL))
        except Exception:
            return False

    async def model_info(self) -> ModelInfo:
        """The `ouro` model's input and output names, from its config (asked once it answers)."""
        if self._info is None:
            try:
                cfg = (await self.client.get_model_config(TRITON_MODEL, as_json=True))["config"]
            except Exception as e:
                raise APIError(f"the {TRITON_MODEL} model does not answer: {e}", status=503) from e
            self._info = ModelInfo(
                frozenset(i["name"] for i in cfg["input"]), frozenset(o["name"] for o in cfg["output"])
            )
        return self._info

    def _infer_inputs(self, req: GenerationRequest) -> list[Any]:
        values: dict[str, Any] = {
            "text_input": req.prompt,
            "stream": True,
            "return_num_input_tokens": True,
            "return_num_output_tokens": True,
            "return_finish_reason": True,
            **{k: v for k, v in req.inputs.items() if v is not None},
        }
        if req.logprobs:  # one token per response, so that each response's text is its token's
            values.update(return_logprobs=True, stream_interval=1)
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

    async def generate(self, req: GenerationRequest) -> AsyncGenerator[Piece, None]:
        """The request's responses up to its final one. Closing the iterator early, or cancelling the task
        that reads it, cancels the Triton request. The model's refusal (a RequestError) raises APIError 400
        with its message; a Triton that does not answer, 503."""
        import grpc

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
                    raise APIError(str(error.message() if callable(getattr(error, "message", None)) else error))
                piece = _piece(result)
                if piece is not None:
                    yield piece
                final = result.get_response().parameters.get("triton_final_response")
                if final is not None and final.bool_param:
                    return
            raise APIError("the server closed the stream before the request finished", status=503)
        except grpc.RpcError as e:
            raise APIError(f"the {TRITON_MODEL} model does not answer: {e.details()}", status=503) from e
        finally:
            done.set()
            it.cancel()


def _piece(result: Any) -> Piece | None:
    """One `ouro` response as a Piece; None for the empty final response."""

    def flat(name: str) -> np.ndarray | None:
        try:
            arr = result.as_numpy(name)
        except Exception:
            return None
        return None if arr is None else arr.reshape(-1)

    text = flat("text_output")
    if text is None:
        return None
    depths, lps = flat("exit_depths"), flat("output_log_probs")
    n_out, n_in, reason = flat("num_output_tokens"), flat("num_input_tokens"), flat("finish_reason")
    return Piece(
        text=text[0].decode("utf-8"),
        depths=[int(d) for d in depths] if depths is not None else [],
        logprobs=[float(x) for x in lps] if lps is not None else [],
        num_output_tokens=int(n_out[0]) if n_out is not None else 0,
        num_input_tokens=int(n_in[0]) if n_in is not None else None,
        finish_reason=(reason[0].decode() or None) if reason is not None else None,
    )


class ContextLimit:
    """The checkpoint's context length and tokenizer: how many tokens a chat prompt leaves for its answer
    when the request gives no max_tokens (vLLM's default)."""

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


async def _disconnected(request: Request) -> None:
    """Returns once the HTTP client has gone away (its body already read: the next ASGI message is the
    disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(grpc_url: str, model_dir: str, served_model_name: str = TRITON_MODEL) -> FastAPI:
    app = FastAPI(title="ouro-triton OpenAI-compatible API")
    backends: list[TritonBackend] = []
    try:
        template = ChatTemplate.of(model_dir)
    except TemplateError as e:
        raise SystemExit(f"{model_dir}/tokenizer_config.json: {e}") from e
    context = ContextLimit(model_dir)
    created = int(time.time())

    def triton() -> TritonBackend:
        if not backends:
            backends.append(TritonBackend(grpc_url))
        return backends[0]

    def error(e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        """A bug here, not a bad request: an OpenAI error object all the same (uvicorn logs the traceback)."""
        return error(APIError(f"internal error: {type(e).__name__}: {e}", status=500))

    async def body_of(request: Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(f"the body is not valid JSON: {e}") from e
        if not isinstance(body, dict):
            raise APIError("the body must be a JSON object")
        model = body.get("model")
        if model != served_model_name:
            raise APIError(
                f"The model `{model}` does not exist (this server serves `{served_model_name}`)",
                "model",
                status=404,
                code="model_not_found",
            )
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
            info = await backend.model_info()
            req = parse_chat(body, template, info) if chat else parse_completion(body, info)
            if req.inputs["max_tokens"] is None:
                req.inputs["max_tokens"] = context.left(req.prompt)
            pieces = backend.generate(req)
            first = await anext(pieces, None)  # the model's own refusals become a 400 before any byte is sent
        except APIError as e:
            return error(e)
        shape = Shape(
            ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, served_model_name, int(time.time()), chat, req
        )
        if req.stream:
            return StreamingResponse(_events(shape, first, pieces), media_type="text/event-stream")

        async def collect() -> Totals:
            totals = Totals()
            try:
                if first is not None:
                    totals.add(first)
                async for p in pieces:
                    totals.add(p)
            finally:
                await pieces.aclose()
            return totals

        work, gone = asyncio.ensure_future(collect()), asyncio.ensure_future(_disconnected(request))
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if not work.done():  # the client went away: cancelling the reader cancels the Triton request
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError, APIError):
                await work
            return Response(status_code=499)
        try:
            return shape.whole(work.result())
        except APIError as e:
            return error(e)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serve(request, chat=True)

    return app


async def _events(shape: Shape, first: Piece | None, pieces: AsyncGenerator[Piece, None]) -> AsyncGenerator[str, None]:
    """The SSE stream of one request. An error after the stream started is one error object, then [DONE];
    a client that goes away ends it here (the generator is closed), which cancels the Triton request."""
    totals = Totals()
    try:
        for chunk in shape.first_chunks():
            yield sse(chunk)
        if first is not None:
            totals.add(first)
            yield sse(shape.chunk(first))
        async for p in pieces:
            totals.add(p)
            yield sse(shape.chunk(p))
        if shape.req.include_usage:
            yield sse(shape.usage_chunk(totals))
    except APIError as e:
        yield sse(e.body())
    finally:
        await pieces.aclose()
    yield "data: [DONE]\n\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m ouro_backend.entrypoints.openai_api", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--grpc-url", default="127.0.0.1:8001", help="the tritonserver's gRPC endpoint")
    p.add_argument("--model", required=True, help="the served checkpoint (its tokenizer_config.json chat template)")
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
