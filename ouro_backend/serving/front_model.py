"""`ouro`: the client-facing model, a decoupled BLS front over preprocessing -> ouro_engine -> postprocessing.

Why not the ensemble: on Triton 24.10 an ensemble does not pass a client's cancellation to its decoupled
step that is already running (DESIGN section 5), so a client that goes away would keep the engine busy and
its KV held until max_tokens. This model owns the client request instead:

* `execute()` validates the request (same rules as the engine, so bad requests fail before any work) and
  starts one worker thread per request; it returns None (decoupled).
* The worker tokenizes through `preprocessing` (BLS), streams `ouro_engine` (BLS, `exec(decoupled=True)`)
  under a request id it chooses, runs `postprocessing` (BLS) on each engine response and sends the result
  to the client in order; the response with a finish reason carries FINAL.
* A watcher thread polls every running request's `response_sender.is_cancelled()` (gRPC
  `stop_stream(cancel_requests=True)`, a cancelled non-streaming gRPC call, or an HTTP SSE client that
  disconnected, seen at the next write) and sends `ouro_engine` a control request with
  `abort_request_id`: the engine drops the request within a round and frees its KV. The worker then
  drains the engine stream and closes the client's response stream with FINAL.

Responses carry the client tensors of protocol.CLIENT_OUTPUTS (`num_input_tokens`, `num_output_tokens`,
`finish_reason` only when the matching `return_*` input is true).
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any

import numpy as np

from ..sampling_params import RequestError
from . import protocol
from .options import client_cancelled, decoupled_model_config, tensor_arrays

log = logging.getLogger("ouro_backend.serving")


class _BLSError(Exception):
    pass


class _Stream:
    """One client request. `lock` orders the FINAL send against `is_cancelled()`: the server releases the
    response factory with the final response, and asking a released sender crashes tritonserver 2.51."""

    __slots__ = ("rid", "sender", "inputs", "parsed", "cancelled", "final_sent", "abort_sent", "lock")

    def __init__(self, rid: str, sender: Any, inputs: dict, parsed: protocol.ParsedRequest):
        self.lock = threading.Lock()
        self.rid = rid
        self.sender = sender
        self.inputs = inputs
        self.parsed = parsed
        self.cancelled = False
        self.final_sent = False
        self.abort_sent = False


class FrontModel:
    """The logic of model_repository/ouro/1/model.py."""

    def initialize(self, args: dict) -> None:
        import triton_python_backend_utils as pb_utils

        self.pb = pb_utils
        self.model_config, self.model_name = decoupled_model_config(pb_utils, args, "ouro")
        params = {k: v.get("string_value", "") for k, v in (self.model_config.get("parameters") or {}).items()}
        self.engine_name = params.get("engine_model") or "ouro_engine"
        self.pre_name = params.get("preprocessing_model") or "preprocessing"
        self.post_name = params.get("postprocessing_model") or "postprocessing"
        self.cancel_interval = float(params.get("cancel_check_interval_s") or 0.02)
        # Detokenize here instead of a BLS call to `postprocessing` per response (same code, one hop less
        # per token: for very high token rates, where the front's BLS calls become the bottleneck).
        self.tokenizer = None
        if (params.get("postprocess_in_process") or "false").strip().lower() in ("1", "true", "yes", "on"):
            from ..tokenizer import load_tokenizer
            from .options import engine_options, resolve_model_path

            options, _ = engine_options(self.model_config, args.get("model_repository"))
            self.tokenizer = load_tokenizer(resolve_model_path({"model": options.get("model", "")})["model"])
        self._lock = threading.Lock()
        self._streams: dict[str, _Stream] = {}
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="ouro-cancel-watcher", daemon=True)
        self._watcher.start()

    # ------------------------------------------------------------------ execute
    def execute(self, requests: list) -> None:
        pb = self.pb
        for request in requests:
            sender = request.get_response_sender()
            try:
                inputs = tensor_arrays(pb.get_input_tensor_by_name, request, protocol.CLIENT_INPUTS)
                protocol.check_parameters(request.parameters(), self.model_name)
                parsed = protocol.parse_request(inputs, specs=protocol.CLIENT_INPUTS, model=self.model_name)
            except RequestError as e:
                self._error(sender, f"{self.model_name}: invalid request: {e}")
                continue
            stream = _Stream(f"{self.model_name}-{uuid.uuid4().hex}", sender, inputs, parsed)
            with self._lock:
                self._streams[stream.rid] = stream
            threading.Thread(target=self._serve, args=(stream,), name=f"ouro-{stream.rid[-8:]}",
                             daemon=True).start()
        return None

    # ------------------------------------------------------------------ one request
    def _serve(self, s: _Stream) -> None:
        pb = self.pb
        try:
            pre = self._infer(self.pre_name, {"text_input": s.inputs["text_input"]}, ["input_ids"])
            if s.cancelled:
                return
            passthrough = [*protocol.SAMPLING_INPUTS, *protocol.RETURN_FLAGS]
            engine_inputs = {name: s.inputs[name] for name in passthrough if name in s.inputs}
            engine_inputs["input_ids"] = pre["input_ids"]
            if s.parsed.echo_prompt:
                engine_inputs["text_input"] = s.inputs["text_input"]
            engine_inputs["request_id"] = np.array([[s.rid.encode()]], dtype=np.object_)
            request = pb.InferenceRequest(
                model_name=self.engine_name, inputs=[pb.Tensor(k, v) for k, v in engine_inputs.items()],
                requested_output_names=list(protocol.ENGINE_OUTPUTS))
            post_outputs = ["text_output", "exit_depths"] + [
                out for flag, out in (("return_num_input_tokens", "num_input_tokens"),
                                      ("return_num_output_tokens", "num_output_tokens"),
                                      ("return_finish_reason", "finish_reason"))
                if getattr(s.parsed, flag)]
            for response in request.exec(decoupled=True):
                if response.has_error():
                    if not s.cancelled:
                        self._fail(s, response.error().message())
                    continue
                engine_out = tensor_arrays(pb.get_output_tensor_by_name, response, protocol.ENGINE_OUTPUTS)
                if "output_ids" not in engine_out or s.final_sent or s.cancelled:
                    continue  # the empty final response of a decoupled BLS stream, or draining after a cancel
                if self.tokenizer is not None:
                    try:
                        post = protocol.postprocess_arrays(self.tokenizer, engine_out)
                    except RequestError as e:
                        raise _BLSError(f"{self.model_name}: {e}") from None
                else:
                    post = self._infer(self.post_name, engine_out, post_outputs)
                final = bool(protocol.read_scalar(engine_out, "finish_reason", protocol.POST_INPUTS, ""))
                out = pb.InferenceResponse(output_tensors=[pb.Tensor(k, v) for k, v in post.items()])
                self._send(s, out, final)
        except _BLSError as e:
            if not s.cancelled:
                self._fail(s, str(e))
                self._abort(s)  # the engine would otherwise run on to max_tokens
        except Exception as e:
            log.exception("ouro front: request %s failed", s.rid)
            self._fail(s, f"{self.model_name}: internal error: {type(e).__name__}: {e}")
            self._abort(s)
        finally:
            with self._lock:
                self._streams.pop(s.rid, None)
            with s.lock:
                if not s.final_sent:
                    s.final_sent = True
                    try:
                        s.sender.send(flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                    except Exception:
                        pass

    def _infer(self, model: str, arrays: dict, outputs: list) -> dict:
        pb = self.pb
        request = pb.InferenceRequest(model_name=model, inputs=[pb.Tensor(k, v) for k, v in arrays.items()],
                                      requested_output_names=outputs)
        response = request.exec()
        if response.has_error():
            raise _BLSError(response.error().message())
        return tensor_arrays(pb.get_output_tensor_by_name, response, outputs)

    def _send(self, s: _Stream, response: Any, final: bool) -> None:
        pb = self.pb
        with s.lock:
            if s.final_sent:
                return
            try:
                s.sender.send(response, flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0)
            except Exception as e:  # the client is gone: the watcher aborts the engine request
                log.debug("send failed for %s: %s", s.rid, e)
            if final:
                s.final_sent = True

    def _fail(self, s: _Stream, message: str) -> None:
        with s.lock:
            if s.final_sent:
                return
            s.final_sent = True
            self._error(s.sender, message)

    def _error(self, sender: Any, message: str) -> None:
        pb = self.pb
        try:
            sender.send(pb.InferenceResponse(output_tensors=[], error=pb.TritonError(message)),
                        flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception as e:
            log.debug("error response failed: %s", e)

    # ------------------------------------------------------------------ cancellation
    def _watch(self) -> None:
        while not self._stop.wait(self.cancel_interval):
            with self._lock:
                streams = [s for s in self._streams.values() if not s.cancelled]
            for s in streams:
                if client_cancelled(s.sender, s.lock, lambda: s.final_sent):
                    s.cancelled = True
                    self._abort(s)

    def _abort(self, s: _Stream) -> None:
        if s.abort_sent:
            return
        s.abort_sent = True
        pb = self.pb
        try:
            request = pb.InferenceRequest(
                model_name=self.engine_name,
                inputs=[pb.Tensor("input_ids", np.zeros((1, 0), dtype=np.int32)),
                        pb.Tensor("abort_request_id", np.array([[s.rid.encode()]], dtype=np.object_))],
                requested_output_names=list(protocol.ENGINE_OUTPUTS))
            for response in request.exec(decoupled=True):
                if response.has_error():
                    log.warning("abort of %s failed: %s", s.rid, response.error().message())
        except Exception:
            log.exception("abort of %s failed", s.rid)

    def finalize(self) -> None:
        self._stop.set()
        if hasattr(self, "_watcher"):
            self._watcher.join(timeout=5)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with self._lock:
                streams = list(self._streams.values())
            if not streams:
                break
            for s in streams:
                if not s.abort_sent:
                    self._abort(s)
            time.sleep(0.05)
