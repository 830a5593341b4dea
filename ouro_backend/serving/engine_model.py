"""`ouro_engine`: the decoupled Python-backend model that owns the engines, callable with token ids.

It starts one engine process per device (ouro_backend.serving.engine_pool; `engine_devices`, default every
visible GPU) and streams each request to the least loaded one; the `ouro` front of the same server sends
its requests to those processes directly, over their sockets. Threads and cancellation:
ouro_backend.serving.streams.

* The engine processes report metrics here (they see every request, the front's too); a reporter thread
  publishes them through pb_utils.MetricFamily, one series per engine (ouro_backend.serving.metrics).
* A control request with `abort_request_id` aborts one of this model's running requests by the id it
  generated for it (its `request_id` output); client-chosen ids cannot be aborted by id.
* If an engine process dies, its open requests get an error response and a new process is started on its
  device; the other engines serve on. Requests go to the live engines meanwhile (refused with a clear
  error only while none is live); the front reconnects by itself.
* `finalize()` answers what is left with an error and stops the engine processes.

Metadata travels in tensors (24.10 cannot attach response parameters): see protocol.ENGINE_OUTPUTS.
"""

from __future__ import annotations

import logging
import os
import uuid
from typing import Any

from ..config import ConfigError, EngineConfig
from ..sampling_params import RequestError
from . import protocol
from .engine_client import EngineClient
from .engine_errors import EngineProcessError
from .engine_messages import FromEngine, Stats
from .engine_pool import EnginePool, EngineRouter, resolve_devices
from .metrics import EngineMetrics
from .options import (
    ServingOptions,
    decoupled_model_config,
    engine_options,
    resolve_model_path,
    tensor_arrays,
    typed_options,
)
from .streams import StreamingModel

log = logging.getLogger(__name__)
GENERATED_ID_PREFIX = "ouro-engine-"  # + 32 hex digits: the ids this model makes for requests without one


class EngineModel(StreamingModel):
    """The logic of model_repository/ouro_engine/1/model.py (which only subclasses it)."""

    metrics = None  # made once the engine processes are up

    def initialize(self, args: dict) -> None:
        import triton_python_backend_utils as pb_utils

        self.pb = pb_utils
        self.model_config, self.model_name = decoupled_model_config(pb_utils, args, "ouro_engine")
        try:
            options, serving_params = engine_options(self.model_config, args.get("model_repository"))
            serving = typed_options(ServingOptions, serving_params)
            config = EngineConfig.from_strings(options)
            config.model = resolve_model_path(options)["model"]
            devices = resolve_devices(serving.engine_devices, config.device)
            self.setup_streams(pb_utils, serving)
            self.pool = EnginePool(
                self.model_name,
                os.getppid(),
                config,
                devices,
                serving.metrics_interval_s,
                self._on_message,
                self._on_closed,
                self._log,
            )
            self.router = EngineRouter(len(devices), self._owner_client)
            self.pool.start()
        except ConfigError as e:
            self.close_streams("")
            # The message is what `tritonserver` prints for the failed load: make it the whole story.
            raise pb_utils.TritonModelException(
                f"{self.model_name}: invalid engine configuration: {e}. Engine options come from the "
                f"`parameters` of {self.model_name}/config.pbtxt, $OURO_ENGINE_ARGS and $OURO_MODEL_PATH"
            ) from None
        except EngineProcessError as e:
            self.close_streams("")
            raise pb_utils.TritonModelException(f"{self.model_name}: {e}") from None
        for index, client in enumerate(self.pool.clients):
            self.router.set_client(index, client)
        first = self.pool.clients[0]
        assert first is not None  # start() connected every engine
        info = first.info
        self.metrics = EngineMetrics(
            pb_utils,
            self.model_name,
            args.get("model_version", "1"),
            info.num_loops,
            serving.metrics_interval_s,
            tuple(devices),
        )
        for slot, client in zip(self.pool.slots, self.pool.clients):
            assert client is not None
            i = client.info
            pb_utils.Logger.log_info(
                f"{self.model_name}: engine {slot.index} ready on {slot.device} (process {i.pid}): "
                f"model={i.model_path} dtype={i.dtype} loops={i.num_loops} max_model_len={i.max_model_len} "
                f"kv_blocks={i.kv_blocks}"
            )
        pb_utils.Logger.log_info(f"{self.model_name}: {len(devices)} engine process(es): {', '.join(devices)}")

    def _owner_client(self, index: int) -> EngineClient:
        """The router's way back to engine `index` after a restart: the pool's new owner connection."""
        client = self.pool.clients[index]
        if client is None or client.closed:
            raise EngineProcessError(f"engine {index} is restarting")
        return client

    def _log(self, level: str, text: str) -> None:
        (self.pb.Logger.log_error if level == "error" else self.pb.Logger.log_info)(f"{self.model_name}: {text}")

    def count_error(self) -> None:
        if self.metrics is not None:
            self.metrics.add("errors", 1)

    def _on_closed(self, index: int) -> None:
        assert self.router is not None  # made before the pool starts
        self.router.set_client(index, None)
        self.on_engine_closed(index)

    def _on_message(self, index: int, msg: FromEngine) -> None:
        if isinstance(msg, Stats):
            if self.metrics is not None:  # None for the stats that come before initialize() made it
                self.metrics.merge(msg.snapshot, index)  # the process counts the requests it rejected or failed
        else:
            self.on_engine_message(index, msg)

    def parse(self, request: Any) -> tuple[protocol.ParsedRequest, list[int], str] | None:
        inputs = tensor_arrays(request.inputs(), protocol.ENGINE_INPUTS)
        protocol.check_parameters(request.parameters(), self.model_name)
        parsed = protocol.parse_request(
            inputs, specs=protocol.ENGINE_INPUTS, prompt_input="input_ids", model=self.model_name
        )
        if parsed.abort_request_id is not None:
            self._abort_by_id(parsed.abort_request_id)
            return None
        if parsed.request_id is not None and parsed.request_id.startswith(GENERATED_ID_PREFIX):
            raise RequestError(f"request_id may not start with {GENERATED_ID_PREFIX!r} (the model's own ids)")
        assert isinstance(parsed.prompt, list)  # input_ids: token ids
        return parsed, parsed.prompt, parsed.request_id or f"{GENERATED_ID_PREFIX}{uuid.uuid4().hex}"

    def _abort_by_id(self, rid: str) -> None:
        """Abort one of this model's requests by the id it generated for it. NOTE: a generated id is a
        128-bit secret that only its request's responses carry, so holding it is what makes a caller the
        request's owner; a client-chosen request_id proves nothing (another client may know or guess it)
        and is refused. A generated id that is no longer running is a no-op (it may have just finished)."""
        if not rid.startswith(GENERATED_ID_PREFIX):
            raise RequestError(
                f"abort_request_id {rid!r} is not an id this model generated: only the request_id "
                "output of a request started without request_id can be aborted by id (cancel "
                "the call itself to stop a request that chose its own)"
            )
        with self._lock:
            stream = self._streams.get(rid)
        if stream is not None:
            self._cancel(stream)

    def response_arrays(self, fields: dict, rid: str) -> dict:
        return {**protocol.engine_response_arrays(**fields), "request_id": protocol.string_array(rid)}

    def finalize(self) -> None:
        self.close_streams(f"{self.model_name}: the model is being unloaded")
        pool = getattr(self, "pool", None)
        if pool is not None:
            pool.close()
        if self.metrics is not None:
            self.metrics.close()
