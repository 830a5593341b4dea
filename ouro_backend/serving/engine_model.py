"""`ouro_engine`: the decoupled Python-backend model that owns one LLMEngine.

Thread design (as in the vLLM Triton backend):
* `execute()` only validates and enqueues: each request is parsed, registered with its response sender and
  handed to `engine.add_request` (thread-safe); a bad request gets a `TritonError` response with FINAL at
  once. It returns None (decoupled).
* One engine thread calls `engine.step()` in a loop and queues the outputs; one response thread sends them
  through each request's response sender, in order, while the engine thread waits on the GPU for the next
  round: streaming requests get a response per step that produced tokens, non-streaming requests one
  response when they finish. The last response carries TRITONSERVER_RESPONSE_COMPLETE_FINAL.
* Every round (at most every `cancel_check_interval_s`), the thread asks each running request's sender
  `is_cancelled()` and aborts cancelled requests in the engine, which frees their KV at once; their last
  response says finish_reason "cancelled".
* A control request with `abort_request_id` aborts a running request by id: the `ouro` front model sends
  one when its client goes away (a BLS request has no cancellation of its own on Triton 24.10).
* `finalize()` stops the thread, aborts what is left and answers it with an error.

Metadata travels in tensors (24.10 cannot attach response parameters): see protocol.ENGINE_OUTPUTS.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
import uuid
from typing import Any, Optional

from ..config import ConfigError, EngineConfig
from ..sampling_params import RequestError
from . import protocol
from .metrics import EngineMetrics
from .options import (client_cancelled, decoupled_model_config, engine_options, tensor_arrays,
                      resolve_model_path)

log = logging.getLogger("ouro_backend.serving")


class _Active:
    """A request the engine is working on, and what has been sent for it. `lock` orders the FINAL send
    (after which `done`) against `is_cancelled()`: asking a sender whose final response went out crashes
    tritonserver 2.51 (the response factory is gone)."""

    __slots__ = ("rid", "sender", "parsed", "num_input", "arrival", "cancelled", "prefix", "ids", "depths",
                 "errored", "started", "lock", "done")

    def __init__(self, rid: str, sender: Any, parsed: protocol.ParsedRequest):
        self.lock = threading.Lock()
        self.done = False
        self.rid = rid
        self.sender = sender
        self.parsed = parsed
        self.num_input = 0
        self.arrival = time.monotonic()
        self.cancelled = False
        self.errored = False
        self.started = False
        self.prefix: Optional[list[int]] = None  # non-streaming: accumulated until the end
        self.ids: list[int] = []
        self.depths: list[int] = []


class EngineModel:
    """The logic of model_repository/ouro_engine/1/model.py (which only subclasses it)."""

    def initialize(self, args: dict) -> None:
        import triton_python_backend_utils as pb_utils

        self.pb = pb_utils
        self.model_config, self.model_name = decoupled_model_config(pb_utils, args, "ouro_engine")
        model_dir = args.get("model_repository")
        options, serving = engine_options(self.model_config, model_dir)
        self.cancel_interval = float(serving.get("cancel_check_interval_s", 0.01))
        try:
            config = EngineConfig.from_strings(options)
            config.model = resolve_model_path(options)["model"]
            from ..engine import LLMEngine

            self.engine = LLMEngine(config)
        except ConfigError as e:
            # The message is what `tritonserver` prints for the failed load: make it the whole story.
            raise pb_utils.TritonModelException(
                f"{self.model_name}: invalid engine configuration: {e}. Engine options come from the "
                f"`parameters` of {self.model_name}/config.pbtxt, $OURO_ENGINE_ARGS and $OURO_MODEL_PATH") from None
        self.engine.want_text = False  # post-processing detokenizes
        self.num_loops = self.engine.model_config.total_ut_steps
        self.metrics = EngineMetrics(pb_utils, self.model_name, args.get("model_version", "1"), self.num_loops,
                                     float(serving.get("metrics_interval_s", 0.25)))
        self._lock = threading.Lock()
        self._active: dict[str, _Active] = {}
        self._early_aborts: dict[str, float] = {}  # aborts that arrived before their request
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._last_cancel_check = 0.0
        self._last_stats = 0.0
        self._outputs: queue.SimpleQueue = queue.SimpleQueue()  # engine thread -> response thread
        self._responder = threading.Thread(target=self._respond_loop, name="ouro-responses", daemon=True)
        self._responder.start()
        self._thread = threading.Thread(target=self._loop, name="ouro-engine", daemon=True)
        self._thread.start()
        pb_utils.Logger.log_info(
            f"{self.model_name}: engine ready: model={self.engine.model_path} device={self.engine.device} "
            f"dtype={self.engine.dtype} loops={self.num_loops} max_model_len={self.engine.max_model_len} "
            f"kv_blocks={self.engine.kv.num_blocks}")

    # ------------------------------------------------------------------ execute (Triton's thread)
    def execute(self, requests: list) -> None:
        pb = self.pb
        for request in requests:
            sender = request.get_response_sender()
            try:
                inputs = tensor_arrays(pb.get_input_tensor_by_name, request, protocol.ENGINE_INPUTS)
                protocol.check_parameters(request.parameters(), self.model_name)
                parsed = protocol.parse_request(inputs, specs=protocol.ENGINE_INPUTS, prompt_input="input_ids",
                                                model=self.model_name)
                if parsed.abort_request_id is not None:
                    self._abort_by_id(parsed.abort_request_id)
                    sender.send(flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                    continue
                self._submit(parsed, sender)
            except RequestError as e:
                self._send_error(sender, f"{self.model_name}: invalid request: {e}")
            except Exception as e:  # a bug, not the client's fault: still answer the request
                log.exception("execute failed")
                self._send_error(sender, f"{self.model_name}: internal error: {type(e).__name__}: {e}")
        self._wake.set()
        return None

    def _submit(self, parsed: protocol.ParsedRequest, sender: Any) -> None:
        rid = parsed.request_id or f"ouro-engine-{uuid.uuid4().hex}"
        state = _Active(rid, sender, parsed)
        with self._lock:
            if rid in self._active:
                raise RequestError(f"request_id {rid!r} is already running")
            early = self._early_aborts.pop(rid, None)
            if early is None:
                self._active[rid] = state
        if early is not None:  # the client gave up before the request got here
            self._send(state, [], [], [], 0, "abort", final=True)
            self.metrics.add("aborted", 1)
            return
        try:
            self.engine.add_request(rid, parsed.prompt, parsed.params)
        except BaseException:
            with self._lock:
                self._active.pop(rid, None)
            with state.lock:
                state.done = True  # the caller answers with the error
            raise
        state.num_input = len(parsed.prompt)

    def _abort_by_id(self, rid: str) -> None:
        with self._lock:
            state = self._active.get(rid)
            if state is None:
                now = time.monotonic()
                self._early_aborts = {k: t for k, t in self._early_aborts.items() if now - t < 60.0}
                self._early_aborts[rid] = now
                return
            if state.cancelled:
                return
            state.cancelled = True
        self.engine.abort_request(rid)
        self._wake.set()

    # ------------------------------------------------------------------ the engine thread
    def _loop(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            try:
                self._check_cancelled()
                if not engine.has_unfinished_requests():
                    self._publish_stats(idle=True)
                    self._wake.wait(self.cancel_interval * 5)
                    self._wake.clear()
                    continue
                try:
                    outputs = engine.step()
                except Exception as e:
                    log.exception("engine.step failed")
                    self._fail_all(f"{self.model_name}: engine error: {type(e).__name__}: {e}")
                    continue
                if outputs:
                    self._outputs.put(outputs)
                self._publish_stats()
            except Exception:  # never let the thread die silently
                log.exception("engine loop error")
                traceback.print_exc()
                time.sleep(0.01)

    def _respond_loop(self) -> None:
        """Sends the engine's outputs; None stops it (after everything queued before it went out)."""
        while True:
            outputs = self._outputs.get()
            if outputs is None:
                return
            for out in outputs:
                try:
                    self._on_output(out)
                except Exception:
                    log.exception("sending a response failed")

    def _check_cancelled(self) -> None:
        now = time.monotonic()
        if now - self._last_cancel_check < self.cancel_interval:
            return
        self._last_cancel_check = now
        with self._lock:
            candidates = [s for s in self._active.values() if not s.cancelled]
        for state in candidates:
            if client_cancelled(state.sender, state.lock, lambda: state.done):
                state.cancelled = True
                self.engine.abort_request(state.rid)

    def _publish_stats(self, idle: bool = False) -> None:
        now = time.monotonic()
        if idle and now - self._last_stats < 0.5:
            return
        if not idle and now - self._last_stats < 0.05:
            return
        self._last_stats = now
        try:
            self.metrics.set_stats(self.engine.stats())
        except Exception:
            log.exception("engine.stats failed")

    def _on_output(self, out) -> None:
        with self._lock:
            state = self._active.get(out.request_id)
            if state is not None and out.finished:
                del self._active[out.request_id]
        if state is None or state.errored:
            return
        m = self.metrics
        if not state.started and out.new_token_ids:
            state.started = True
            m.add("prompt_tokens", len(out.prompt_token_ids))
        m.add("generation_tokens", len(out.new_token_ids))
        m.observe_many("depth", out.new_exit_depths)
        if state.parsed.stream:
            if out.new_token_ids or out.finished:
                self._send(state, out.new_token_ids, out.prefix_token_ids, out.new_exit_depths,
                           out.trim_chars, out.finish_reason, final=out.finished)
        else:
            if state.prefix is None and out.new_token_ids:
                state.prefix = list(out.prefix_token_ids)
            state.ids.extend(out.new_token_ids)
            state.depths.extend(out.new_exit_depths)
            if out.finished:
                prefix = state.prefix if state.prefix is not None else list(out.prefix_token_ids)
                self._send(state, state.ids, prefix, state.depths, out.trim_chars, out.finish_reason, final=True)
        if out.finished:
            reason = protocol.finish_reason_name(out.finish_reason)
            m.finished(reason)
            if reason == "cancelled":
                m.add("aborted", 1)
            if out.first_token_time is not None:
                m.observe("ttft", out.first_token_time - out.arrival_time)
                if len(out.token_ids) > 1 and out.finish_time is not None:
                    m.observe("tpot", (out.finish_time - out.first_token_time) / (len(out.token_ids) - 1))
            if out.finish_time is not None:
                m.observe("latency", out.finish_time - out.arrival_time)
            self._wake.set()

    def _send(self, state: _Active, ids, prefix, depths, trim: int, reason: Optional[str], final: bool) -> None:
        pb = self.pb
        arrays = protocol.engine_response_arrays(
            ids, prefix, depths, trim, state.num_input, reason if final else None,
            echo_text=(state.parsed.prompt_text or "") if final and state.parsed.echo_prompt else "",
            return_flags=(state.parsed.return_num_input_tokens, state.parsed.return_num_output_tokens,
                          state.parsed.return_finish_reason))
        response = pb.InferenceResponse(output_tensors=[pb.Tensor(k, v) for k, v in arrays.items()])
        with state.lock:
            if state.done:
                return
            try:
                state.sender.send(response, flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0)
            except Exception as e:  # the client is gone; the cancellation check will abort the request
                log.debug("send failed for %s: %s", state.rid, e)
            state.done = final

    def _send_error(self, sender: Any, message: str) -> None:
        pb = self.pb
        self.metrics.add("errors", 1)
        try:
            sender.send(pb.InferenceResponse(output_tensors=[], error=pb.TritonError(message)),
                        flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception as e:
            log.debug("error response failed: %s", e)

    def _fail_all(self, message: str) -> None:
        with self._lock:
            states, self._active = list(self._active.values()), {}
        for state in states:
            state.errored = True
            self.engine.abort_request(state.rid)
            with state.lock:
                if state.done:
                    continue
                state.done = True
                self._send_error(state.sender, message)

    # ------------------------------------------------------------------ unload
    def finalize(self) -> None:
        self._stop.set()
        self._wake.set()
        thread = getattr(self, "_thread", None)
        if thread is not None:
            thread.join(timeout=30)
        responder = getattr(self, "_responder", None)
        if responder is not None:
            self._outputs.put(None)
            responder.join(timeout=30)
        if hasattr(self, "_active"):
            self._fail_all(f"{self.model_name}: the model is being unloaded")
        metrics = getattr(self, "metrics", None)
        if metrics is not None:
            metrics.close()
