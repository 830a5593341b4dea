#!/usr/bin/env python3
"""Stream a prompt from the Ouro Triton deployment and print the text as it arrives.

    python client/ouro_client.py "Once upon a time" --max-tokens 64
    python client/ouro_client.py "Hello" --protocol http            # /v2/models/ouro/generate_stream (SSE)
    python client/ouro_client.py "Hello" --no-stream                 # one response
    python client/ouro_client.py "Hello" --model ouro_ensemble --exit-threshold 0.7 --json

gRPC uses tritonclient's `start_stream` / `async_stream_infer` (ModelStreamInfer); HTTP uses only the
standard library. After the text, a summary: tokens, total time, overall tokens/s and mean exit depth, and
when streaming also the time to first token and the decode rate (tokens after the first response / time
from the first to the last response); `--no-stream` gets one response at the end, so it has neither.
The functions here (`build_inputs`, `GrpcStream`, `stream_grpc`, `stream_http`, `generate`) are what the tests and the
load generator use.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import os
import queue
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

SAMPLE_PROMPTS = [  # the load generator's and perf_analyzer recipe's default prompts
    "Once upon a time there was a little robot who",
    "The quick brown fox jumps over the lazy dog. Then",
    "In the kitchen, the recipe called for two cups of flour and",
    "Questions and answers: What is the capital of France?",
    "The weather today is sunny with a few clouds, and tomorrow",
    "def add(a, b):\n    return",
    "A looped language model runs the same layers several times:",
    "Le café est très bon ce matin. Où est la bibliothèque?",
    "User: Hello! Can you help me? Assistant:",
]

SCALAR_TYPES = {  # client-facing optional inputs: numpy dtype, Triton dtype
    "max_tokens": (np.int64, "INT64"),
    "min_tokens": (np.int64, "INT64"),
    "stream": (np.bool_, "BOOL"),
    "stream_interval": (np.int64, "INT64"),
    "temperature": (np.float32, "FP32"),
    "top_p": (np.float32, "FP32"),
    "top_k": (np.int64, "INT64"),
    "seed": (np.uint64, "UINT64"),
    "random_seed": (np.uint64, "UINT64"),
    "ignore_eos": (np.bool_, "BOOL"),
    "exclude_input_in_output": (np.bool_, "BOOL"),
    "return_num_input_tokens": (np.bool_, "BOOL"),
    "return_num_output_tokens": (np.bool_, "BOOL"),
    "return_finish_reason": (np.bool_, "BOOL"),
    "return_spec_counts": (np.bool_, "BOOL"),
    "return_num_cached_tokens": (np.bool_, "BOOL"),
    "return_logprobs": (np.bool_, "BOOL"),
    "repetition_penalty": (np.float32, "FP32"),
    "presence_penalty": (np.float32, "FP32"),
    "frequency_penalty": (np.float32, "FP32"),
    "min_loops": (np.int64, "INT64"),
    "max_loops": (np.int64, "INT64"),
    "exit_threshold": (np.float32, "FP32"),
}


@dataclass
class Chunk:
    """One response of a stream."""

    text: str
    exit_depths: list[int]
    num_output_tokens: int | None = None
    num_input_tokens: int | None = None
    finish_reason: str | None = None
    num_spec_drafted_tokens: int | None = None  # with return_spec_counts: the request's totals so far
    num_spec_accepted_tokens: int | None = None
    num_cached_tokens: int | None = None  # with return_num_cached_tokens: prompt tokens from the prefix cache
    log_probs: list[float] | None = None  # with return_logprobs: each token's logprob
    time: float = 0.0  # time.monotonic() when it arrived (gRPC: when the stream's callback had it)


@dataclass
class Result:
    chunks: list[Chunk] = field(default_factory=list)
    start: float = 0.0
    end: float = 0.0
    error: str | None = None
    # Whether the request streamed (stream: true). Without streaming the one response comes when the request
    # is done, so there is no time to first token and no decode rate: only the total time.
    streamed: bool = True

    @property
    def text(self) -> str:
        return "".join(c.text for c in self.chunks)

    @property
    def exit_depths(self) -> list[int]:
        return [d for c in self.chunks for d in c.exit_depths]

    @staticmethod
    def _tokens_of(chunks: list[Chunk]) -> int:
        counted = [c.num_output_tokens for c in chunks]
        if counted and all(n is not None for n in counted):
            return int(sum(counted))
        return sum(len(c.exit_depths) for c in chunks)

    @property
    def log_probs(self) -> list[float]:
        return [x for c in self.chunks for x in c.log_probs or []]

    @property
    def num_tokens(self) -> int:
        return self._tokens_of(self.chunks)

    @property
    def finish_reason(self) -> str | None:
        reasons = [c.finish_reason for c in self.chunks if c.finish_reason]
        return reasons[-1] if reasons else None

    def _token_chunks(self) -> list[Chunk]:
        return [c for c in self.chunks if c.exit_depths or c.text]

    @property
    def ttft(self) -> float | None:
        """Time to the first response with a token; None without streaming."""
        if not self.streamed:
            return None
        first = next(iter(self._token_chunks()), None)
        return first.time - self.start if first else None

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens after the first response / time from the first to the last response with tokens. None
        without streaming, or when fewer than two responses carried tokens (nothing to time)."""
        chunks = self._token_chunks()
        if not self.streamed or len(chunks) < 2:
            return None
        later = self._tokens_of(chunks[1:])
        span = chunks[-1].time - chunks[0].time
        return later / span if later > 0 and span > 0 else None

    def summary(self) -> dict[str, Any]:
        depths = self.exit_depths
        dur = self.end - self.start
        n = self.num_tokens
        return {
            "tokens": n,
            "responses": len(self.chunks),
            "streamed": self.streamed,
            "finish_reason": self.finish_reason,
            "ttft_s": self.ttft,
            "total_s": dur,
            "tokens_per_s": n / dur if dur > 0 else None,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "mean_exit_depth": sum(depths) / len(depths) if depths else None,
            "error": self.error,
        }

    def summary_line(self) -> str:
        """The one-line summary the command prints: only what this request's responses can measure."""
        s = self.summary()

        def fmt(v, f):
            return "-" if v is None else format(v, f)

        parts = [f"{s['tokens']} tokens", f"finish_reason={s['finish_reason']}"]
        if self.streamed:
            parts.append(f"TTFT {fmt(s['ttft_s'], '.3f')} s")
        parts.append(f"total {s['total_s']:.3f} s")
        rate = f"{fmt(s['tokens_per_s'], '.1f')} tok/s overall"
        if self.streamed:
            rate += f" (decode {fmt(s['decode_tokens_per_s'], '.1f')} tok/s)"
        parts.append(rate)
        parts.append(f"mean exit depth {fmt(s['mean_exit_depth'], '.2f')}")
        if not self.streamed:
            parts.append("not streamed: no TTFT or decode rate")
        return "--- " + ", ".join(parts)


def load_prompts(path: str) -> list[str]:
    """A `--prompts-file` (client/load.py, client/perf_analyzer/run_perf.py): a non-empty JSON list of strings."""
    with open(path, encoding="utf-8") as f:
        prompts = json.load(f)
    if not (isinstance(prompts, list) and prompts and all(isinstance(x, str) for x in prompts)):
        raise SystemExit(f"--prompts-file {path}: expected a non-empty JSON list of strings")
    return prompts


def request_options(max_tokens: int = 64, stream: bool = True, **kwargs) -> dict[str, Any]:
    """The optional inputs of a request (None values dropped). Keys: SCALAR_TYPES, stop_words, bad_words and
    sampling_parameters (a JSON string)."""
    opts = {"max_tokens": max_tokens, "stream": stream, **kwargs}
    return {k: v for k, v in opts.items() if v is not None}


def build_inputs(tc: Any, prompt: str, options: dict[str, Any]) -> list:
    """tritonclient InferInput list ([1, 1] shapes: the models have max_batch_size 1). `tc` is
    tritonclient.grpc or tritonclient.http."""
    inputs = []

    def add(name: str, arr: np.ndarray, dtype: str) -> None:
        t = tc.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        inputs.append(t)

    add("text_input", np.array([[prompt.encode("utf-8")]], dtype=np.object_), "BYTES")
    for name, value in options.items():
        if value is None:
            continue
        if name in ("stop_words", "bad_words"):
            words = [value] if isinstance(value, str) else list(value)
            add(name, np.array([[w.encode("utf-8") for w in words]], dtype=np.object_), "BYTES")
        elif name == "sampling_parameters":
            add(name, np.array([[value.encode("utf-8")]], dtype=np.object_), "BYTES")
        elif name in SCALAR_TYPES:
            np_type, dtype = SCALAR_TYPES[name]
            add(name, np.array([[value]], dtype=np_type), dtype)
        else:
            raise ValueError(f"unknown option {name!r}")
    return inputs


def _chunk_from_arrays(get) -> Chunk:
    def scalar(name):
        arr = get(name)
        if arr is None:
            return None
        v = arr.reshape(-1)[0]
        return v.decode("utf-8") if isinstance(v, bytes) else int(v)

    text = get("text_output")
    depths = get("exit_depths")
    log_probs = get("output_log_probs")
    return Chunk(
        text=text.reshape(-1)[0].decode("utf-8") if text is not None else "",
        exit_depths=[int(d) for d in depths.reshape(-1)] if depths is not None else [],
        num_output_tokens=scalar("num_output_tokens"),
        num_input_tokens=scalar("num_input_tokens"),
        finish_reason=scalar("finish_reason"),
        num_spec_drafted_tokens=scalar("num_spec_drafted_tokens"),
        num_spec_accepted_tokens=scalar("num_spec_accepted_tokens"),
        num_cached_tokens=scalar("num_cached_tokens"),
        log_probs=[float(x) for x in log_probs.reshape(-1)] if log_probs is not None else None,
        time=time.monotonic(),
    )


class GrpcStream:
    """One ModelStreamInfer stream kept open for request after request, one request at a time, the way
    perf_analyzer's streaming mode drives a server. Opening a stream per request costs the client a
    handler thread and, on closing, a round trip to the server before the next request can go out.

    A request that does not end with its final response (error, timeout, the caller stopping early)
    closes the stream, so nothing late from it can reach the next request; the next one opens a new one."""

    def __init__(self, url: str, trace: Any = None):
        import tritonclient.grpc as grpcclient

        self._grpc = grpcclient
        self.client = grpcclient.InferenceServerClient(url)
        self._responses: queue.Queue = queue.Queue()
        self._open = False
        self._ids = itertools.count()
        # A RequestTrace (ouro_backend.serving.request_trace) that notes when each request was sent and when
        # the stream's callback had its first response: the client's ends of the server's hop timing.
        self.trace = trace

    def request(self, model: str, prompt: str, options: dict[str, Any], timeout: float = 600.0) -> Iterator[Chunk]:
        """Send one request and yield its responses until the final one."""
        if not self._open:
            responses = self._responses = queue.Queue()
            self.client.start_stream(callback=lambda result, error: responses.put((result, error, time.monotonic())))
            self._open = True
        rid = f"load-{os.getpid()}-{id(self):x}-{next(self._ids)}"
        finished = False
        trace = self.trace
        try:
            inputs = build_inputs(self._grpc, prompt, options)
            if trace is not None:
                trace.mark(rid, "sent")
            self.client.async_stream_infer(model, inputs, request_id=rid, enable_empty_final_response=True)
            deadline = time.monotonic() + timeout
            while True:
                result, error, arrived = self._responses.get(timeout=max(0.01, deadline - time.monotonic()))
                if error is not None:
                    raise RuntimeError(str(error))
                response = result.get_response()
                final = response.parameters.get("triton_final_response")
                is_final = final is not None and final.bool_param
                if response.outputs:
                    if trace is not None:
                        trace.mark(rid, "received", arrived)
                    chunk = _chunk_from_arrays(result.as_numpy)
                    chunk.time = arrived  # not when this thread got to it: a busy client must not add its own wait
                    yield chunk
                if is_final:
                    finished = True
                    return
        finally:
            if not finished:
                self.close_stream()

    def close_stream(self) -> None:
        if self._open:
            self._open = False
            self.client.stop_stream()

    def close(self) -> None:
        self.close_stream()
        self.client.close()


def stream_grpc(url: str, model: str, prompt: str, options: dict[str, Any], timeout: float = 600.0) -> Iterator[Chunk]:
    """Send one request over a ModelStreamInfer stream of its own and yield its responses until the final one."""
    stream = GrpcStream(url)
    try:
        yield from stream.request(model, prompt, options, timeout)
    finally:
        stream.close()


def _json_to_chunk(d: dict) -> Chunk:
    def arr(name):
        if name not in d:
            return None
        v = d[name]
        if isinstance(v, str):
            return np.array([v.encode("utf-8")], dtype=np.object_)
        return np.array(v if isinstance(v, list) else [v])

    return _chunk_from_arrays(arr)


def stream_http(url: str, model: str, prompt: str, options: dict[str, Any], timeout: float = 600.0) -> Iterator[Chunk]:
    """POST /v2/models/{model}/generate_stream (or /generate when stream is false) and yield responses."""
    body = {"text_input": prompt, **{k: v for k, v in options.items() if v is not None}}
    endpoint = "generate_stream" if options.get("stream") else "generate"
    host, _, port = url.replace("http://", "").partition(":")
    conn = http.client.HTTPConnection(host, int(port or 80), timeout=timeout)
    try:
        conn.request(
            "POST",
            f"/v2/models/{model}/{endpoint}",
            body=json.dumps(body),
            headers={"Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        if endpoint == "generate":
            data = json.loads(resp.read() or b"{}")
            if resp.status != 200 or "error" in data:
                raise RuntimeError(data.get("error") or f"HTTP {resp.status}")
            yield _json_to_chunk(data)
            return
        if resp.status != 200:
            raise RuntimeError(resp.read().decode(errors="replace") or f"HTTP {resp.status}")
        while True:
            line = resp.readline()
            if not line:
                return
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = json.loads(line[5:])
            if "error" in data:
                raise RuntimeError(data["error"])
            yield _json_to_chunk(data)
    finally:
        conn.close()


def generate(
    url: str,
    model: str,
    prompt: str,
    options: dict[str, Any],
    protocol: str = "grpc",
    timeout: float = 600.0,
    on_chunk=None,
    grpc_stream: GrpcStream | None = None,
) -> Result:
    """Run one request to completion; errors end up in Result.error. `grpc_stream`: an open stream to
    reuse (a load generator's worker keeps one, as perf_analyzer does)."""
    result = Result(start=time.monotonic(), streamed=bool(options.get("stream")))
    if grpc_stream is not None:
        stream = grpc_stream.request(model, prompt, options, timeout)
    elif protocol == "grpc":
        stream = stream_grpc(url, model, prompt, options, timeout)
    else:
        stream = stream_http(url, model, prompt, options, timeout)
    try:
        for chunk in stream:
            result.chunks.append(chunk)
            if on_chunk:
                on_chunk(chunk)
    except Exception as e:
        result.error = str(e)
    result.end = time.monotonic()
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("prompt")
    p.add_argument("--protocol", choices=["grpc", "http"], default="grpc")
    p.add_argument("--url", default=None, help="default localhost:8001 (gRPC) / localhost:8000 (HTTP)")
    p.add_argument("--model", default="ouro", help="ouro (cancellable front) or ouro_ensemble")
    p.add_argument("--no-stream", action="store_true", help="one response with the whole text")
    p.add_argument("--echo", action="store_true", help="non-streaming: include the prompt in the text")
    p.add_argument(
        "--stream-interval",
        type=int,
        default=None,
        help="tokens per streamed response (1: one token each; default: the server's, which coalesces)",
    )
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--min-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--min-loops", type=int, default=None)
    p.add_argument("--max-loops", type=int, default=None)
    p.add_argument("--exit-threshold", type=float, default=None)
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--timeout", type=float, default=600.0)
    args = p.parse_args(argv)
    url = args.url or ("localhost:8001" if args.protocol == "grpc" else "localhost:8000")
    options = request_options(
        max_tokens=args.max_tokens,
        stream=not args.no_stream,
        stream_interval=args.stream_interval,
        min_tokens=args.min_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop_words=args.stop,
        ignore_eos=args.ignore_eos or None,
        min_loops=args.min_loops,
        max_loops=args.max_loops,
        exit_threshold=args.exit_threshold,
        exclude_input_in_output=None if args.echo else True,
        return_num_input_tokens=True,
        return_num_output_tokens=True,
        return_finish_reason=True,
    )

    def show(chunk: Chunk) -> None:
        sys.stdout.write(chunk.text)
        sys.stdout.flush()

    result = generate(url, args.model, args.prompt, options, args.protocol, args.timeout, on_chunk=show)
    print()
    if result.error:
        print(f"error: {result.error}", file=sys.stderr)
    if args.json:
        print(json.dumps(result.summary(), indent=2))
    else:
        print(result.summary_line(), file=sys.stderr)
    return 1 if result.error else 0


if __name__ == "__main__":
    sys.exit(main())
