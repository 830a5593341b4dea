"""`ouro_engine`: the decoupled Python-backend model that owns the engine, callable with token ids.

It starts the engine in a process of its own (ouro_backend.serving.engine_process) and streams requests to it;
the `ouro` front of the same server sends its requests to that process directly, over the socket at
`engine_address(model name, server pid)`. Threads and cancellation: ouro_backend.serving.streams.

* The engine process reports metrics here (it sees every request, the front's too); a reporter thread
  publishes them through pb_utils.MetricFamily (ouro_backend.serving.metrics).
* A control request with `abort_request_id` aborts a running request by id.
* If the engine process dies, every open request gets an error response, and a new engine process is
  started (requests are refused with a clear error until it is ready; the front reconnects by itself).
* `finalize()` answers what is left with an error and stops the engine process.

Metadata travels in tensors (24.10 cannot attach response parameters): see protocol.ENGINE_OUTPUTS.
"""
from __future__ import annotations

import logging
import os
import threading
import uuid
from typing import Any, Optional

from ..config import ConfigError, EngineConfig
from . import protocol
from .engine_process import EngineClient, EngineProcessError, engine_address, start_engine_process
from .metrics import EngineMetrics
from .options import (ServingOptions, decoupled_model_config, engine_options, resolve_model_path, tensor_arrays,
                      typed_options)
from .streams import StreamingModel

log = logging.getLogger("ouro_backend.serving")


class EngineModel(StreamingModel):
    """The logic of model_repository/ouro_engine/1/model.py (which only subclasses it)."""

    metrics = None  # made once the engine process is up

    def initialize(self, args: dict) -> None:
        import triton_python_backend_utils as pb_utils

        self.pb = pb_utils
        self.model_config, self.model_name = decoupled_model_config(pb_utils, args, "ouro_engine")
        try:
            options, serving_params = engine_options(self.model_config, args.get("model_repository"))
            serving = typed_options(ServingOptions, serving_params)
            config = EngineConfig.from_strings(options)
            config.model = resolve_model_path(options)["model"]
            self.setup_streams(pb_utils, serving)
            self._engine_config, self._metrics_interval_s = config, serving.metrics_interval_s
            self._unloading = False
            self.client, self.process = self._start_engine()
        except ConfigError as e:
            self.close_streams("")
            # The message is what `tritonserver` prints for the failed load: make it the whole story.
            raise pb_utils.TritonModelException(
                f"{self.model_name}: invalid engine configuration: {e}. Engine options come from the "
                f"`parameters` of {self.model_name}/config.pbtxt, $OURO_ENGINE_ARGS and $OURO_MODEL_PATH") from None
        except EngineProcessError as e:
            self.close_streams("")
            raise pb_utils.TritonModelException(f"{self.model_name}: {e}") from None
        info = self.client.info
        self.metrics = EngineMetrics(pb_utils, self.model_name, args.get("model_version", "1"), info.num_loops,
                                     serving.metrics_interval_s)
        pb_utils.Logger.log_info(
            f"{self.model_name}: engine ready (process {info.pid}): model={info.model_path} device={info.device} "
            f"dtype={info.dtype} loops={info.num_loops} max_model_len={info.max_model_len} "
            f"kv_blocks={info.kv_blocks}")

    def engine(self) -> EngineClient:
        if self.client.closed:
            raise EngineProcessError("the engine process exited and is being restarted; see the server log")
        return self.client

    def _start_engine(self):
        return start_engine_process(self._engine_config, engine_address(self.model_name, os.getppid()),
                                    self._on_message, self._on_closed, self._metrics_interval_s)

    def count_error(self) -> None:
        if self.metrics is not None:
            self.metrics.add("errors", 1)

    def _on_closed(self) -> None:
        self.on_engine_closed()
        if not self._unloading:
            threading.Thread(target=self._restart, name="ouro-engine-restart", daemon=True).start()

    def _restart(self) -> None:
        code = self.process.wait()
        self.pb.Logger.log_error(f"{self.model_name}: the engine process {self.process.pid} exited with code "
                                 f"{code}; starting a new one")
        try:
            self.client, self.process = self._start_engine()
        except Exception as e:
            self.pb.Logger.log_error(f"{self.model_name}: the engine process could not be restarted ({e}); "
                                     "reload the model")
            return
        self.pb.Logger.log_info(f"{self.model_name}: engine process {self.client.info.pid} ready")

    def _on_message(self, msg: tuple) -> None:
        if msg[0] == "stats":
            if self.metrics is not None:  # None for the stats that come before initialize() made it
                self.metrics.merge(msg[1])  # the process counts the requests it rejected or failed
        else:
            self.on_engine_message(msg)

    def parse(self, request: Any) -> Optional[tuple[protocol.ParsedRequest, list[int], str]]:
        inputs = tensor_arrays(self.pb.get_input_tensor_by_name, request, protocol.ENGINE_INPUTS)
        protocol.check_parameters(request.parameters(), self.model_name)
        parsed = protocol.parse_request(inputs, specs=protocol.ENGINE_INPUTS, prompt_input="input_ids",
                                        model=self.model_name)
        if parsed.abort_request_id is not None:
            self.engine().abort(parsed.abort_request_id)
            return None
        return parsed, parsed.prompt, parsed.request_id or f"ouro-engine-{uuid.uuid4().hex}"

    def finalize(self) -> None:
        self._unloading = True
        self.close_streams(f"{self.model_name}: the model is being unloaded")
        client = getattr(self, "client", None)
        if client is not None:
            client.close()  # the engine process exits when its owner channel closes
            try:
                self.process.wait(timeout=30)
            except Exception:
                self.process.kill()
        if self.metrics is not None:
            self.metrics.close()
