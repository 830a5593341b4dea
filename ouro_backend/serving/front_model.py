"""`ouro`: the client-facing model. Text in, text out, streamed in order, cancellable.

It does what the ensemble `preprocessing` -> `ouro_engine` -> `postprocessing` does, with the same
protocol functions (tokenize, detokenize: protocol.py), but in-process and talking to the engine processes
of `ouro_engine` directly over their sockets (engine_pool):
* no BLS: a decoupled BLS stream per request (`exec(decoupled=True)`) crashed the 24.10 stub in a native
  thread under concurrent load (it failed CI), and every BLS hop adds a server round trip per token;
* cancellation works (the reason this model exists: an ensemble cannot cancel its running decoupled
  step; serving/README.md): the watcher sees a gRPC
  `stop_stream(cancel_requests=True)`, a cancelled call or an HTTP disconnect through `is_cancelled()`
  and aborts the request in the engine, which frees its KV within a round.

The engines are the engine processes of `engine_model` of the same server (default `ouro_engine`), one
per device, found through the manifest its pool leaves (engine_pool); each new request goes to the least
loaded one. The front connects in the background at load, waiting up to `engine_connect_timeout_s` for the
engines; requests that come meanwhile queue behind it. Later, an engine that is gone is retried at most
once a second by the requests that come, which go to the live engines meanwhile (and fail at once if none
is live); after `ouro_engine` restarts an engine, the next request reconnects to it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any

from . import protocol
from .engine_client import EngineClient
from .engine_errors import EngineProcessError
from .engine_pool import EngineRouter, EngineSlot, read_manifest
from .options import FrontOptions, decoupled_model_config, front_parameters, tensor_arrays, typed_options
from .streams import StreamingModel

if TYPE_CHECKING:
    from tokenizers import Tokenizer

log = logging.getLogger(__name__)


class FrontModel(StreamingModel):
    """The logic of model_repository/ouro/1/model.py."""

    def initialize(self, args: dict) -> None:
        import triton_python_backend_utils as pb_utils

        self.pb = pb_utils
        self.model_config, self.model_name = decoupled_model_config(pb_utils, args, "ouro")
        try:
            self.options = typed_options(FrontOptions, front_parameters(self.model_config))
        except ValueError as e:
            raise pb_utils.TritonModelException(f"{self.model_name}: {e}") from None
        self._slots: list[EngineSlot] = []
        self.router: EngineRouter | None = None
        self._tokenizer: Tokenizer | None = None
        self._tokenizer_path: str | None = None
        self._prompt_limit = (0, 0)  # (bytes, tokens): the longest prompt the engine's context can take
        self._connect_lock = threading.Lock()
        self.setup_streams(pb_utils, self.options)
        # Connect (and load the tokenizer) now if the engines are up, so the first request does not wait.
        threading.Thread(target=self._connect_quietly, name="ouro-connect", daemon=True).start()

    def _connect_quietly(self) -> None:
        try:
            self._connect_all(timeout_s=self.options.engine_connect_timeout_s)
        except EngineProcessError as e:
            log.warning("%s: %s (requests will retry)", self.model_name, e)

    def _connect_all(self, timeout_s: float = 0.0) -> EngineRouter:
        """The router over every engine of `engine_model`, made at the first call that finds them (waiting
        up to `timeout_s` for the manifest and for each engine). Requests that come while the start-up
        connect is still waiting queue on the lock behind it."""
        if self.router is not None:
            return self.router
        with self._connect_lock:
            if self.router is not None:
                return self.router
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    self._slots = read_manifest(self.options.engine_model, os.getppid())
                    break
                except OSError:
                    if time.monotonic() >= deadline:
                        raise EngineProcessError(
                            f"no engine processes of {self.options.engine_model} in this server (is that model loaded?)"
                        ) from None
                    time.sleep(0.2)
            router = EngineRouter(len(self._slots), self._connect)
            for slot in self._slots:
                try:
                    router.set_client(slot.index, self._connect(slot.index, max(0.0, deadline - time.monotonic())))
                except EngineProcessError as e:  # the others serve; this one is retried by requests
                    log.warning("%s: engine %d: %s", self.model_name, slot.index, e)
            if not any(c is not None for c in router.clients):
                raise EngineProcessError(
                    f"none of the {len(self._slots)} engine process(es) of {self.options.engine_model} answers"
                )
            self.router = router
            return router

    def _connect(self, index: int, timeout_s: float = 0.0) -> EngineClient:
        slot = self._slots[index]
        client = EngineClient.connect(
            slot.address,
            lambda msg: self.on_engine_message(index, msg),
            lambda: self.on_engine_closed(index),
            timeout_s=timeout_s,
        )
        if client.info.model_path != self._tokenizer_path:
            from ..model.tokenizer import load_tokenizer

            self._tokenizer = load_tokenizer(client.info.model_path)
            self._tokenizer_path = client.info.model_path
            context = client.info.max_model_len
            self._prompt_limit = (protocol.prompt_byte_limit(self._tokenizer, context), context)
        self.pb.Logger.log_info(
            f"{self.model_name}: connected to engine {index} ({slot.device}, process "
            f"{client.info.pid}) of {self.options.engine_model} ({client.info.model_path})"
        )
        return client

    def parse(self, request: Any) -> tuple[protocol.ParsedRequest, list[int], str]:
        inputs = tensor_arrays(request.inputs(), protocol.CLIENT_INPUTS)
        protocol.check_parameters(request.parameters(), self.model_name)
        self._connect_all()  # the tokenizer comes with the connections
        protocol.check_prompt_bytes(inputs, "text_input", *self._prompt_limit)
        parsed = protocol.parse_request(inputs, specs=protocol.CLIENT_INPUTS, model=self.model_name)
        assert isinstance(parsed.prompt, str)  # text_input
        ids = protocol.tokenize_arrays(self._tokenizer, parsed.prompt)["input_ids"].reshape(-1).tolist()
        return parsed, ids, f"{self.model_name}-{uuid.uuid4().hex}"

    def response_arrays(self, fields: dict, rid: str) -> dict:
        # Straight from the fields, with the function `postprocessing` ends in: the ensemble's text by
        # construction, without building and reading back the engine's tensors (serving/README.md).
        return protocol.client_response_arrays(self._tokenizer, **fields)

    def count_error(self) -> None:
        """The metrics live in `ouro_engine`: an engine process counts this error for it."""
        router = self.router
        if router is None:
            return
        for i in range(len(router)):
            client = router.clients[i]
            if client is not None and not client.closed:
                try:
                    client.count_error()
                    return
                except EngineProcessError:
                    pass

    def finalize(self) -> None:
        self.close_streams(f"{self.model_name}: the model is being unloaded")
        router = getattr(self, "router", None)
        if router is not None:
            router.close()  # each engine process aborts this connection's requests
