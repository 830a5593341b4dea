"""`ouro`: the client-facing model. Text in, text out, streamed in order, cancellable.

It does what the ensemble `preprocessing` -> `ouro_engine` -> `postprocessing` does, with the same
protocol functions (tokenize, detokenize: protocol.py), but in-process and talking to the engine process
of `ouro_engine` directly over its socket (engine_process.engine_address):
* no BLS: a decoupled BLS stream per request (`exec(decoupled=True)`) crashed the 24.10 stub in a native
  thread under concurrent load (it failed CI), and every BLS hop adds a server round trip per token;
* cancellation works (the reason this model exists: an ensemble cannot cancel its running decoupled
  step; serving/README.md): the watcher sees a gRPC
  `stop_stream(cancel_requests=True)`, a cancelled call or an HTTP disconnect through `is_cancelled()`
  and aborts the request in the engine, which frees its KV within a round.

The engine must be `engine_model` of the same server (default `ouro_engine`). The front connects in the
background at load, waiting up to `engine_connect_timeout_s` for the engine; requests that come meanwhile
queue behind it. Later, a request that finds no connection tries once, and fails at once if no engine is
there; after `ouro_engine` restarts its engine, the next request reconnects.
"""
from __future__ import annotations

import logging
import os
import threading
import uuid
from typing import Any, Optional

from . import protocol
from .engine_process import EngineClient, EngineProcessError, engine_address
from .options import FrontOptions, decoupled_model_config, model_config_parameters, tensor_arrays, typed_options
from .streams import StreamingModel

log = logging.getLogger("ouro_backend.serving")


class FrontModel(StreamingModel):
    """The logic of model_repository/ouro/1/model.py."""

    def initialize(self, args: dict) -> None:
        import triton_python_backend_utils as pb_utils

        self.pb = pb_utils
        self.model_config, self.model_name = decoupled_model_config(pb_utils, args, "ouro")
        try:
            self.options = typed_options(FrontOptions, model_config_parameters(self.model_config))
        except ValueError as e:
            raise pb_utils.TritonModelException(f"{self.model_name}: {e}") from None
        self.address = engine_address(self.options.engine_model, os.getppid())
        self._client: Optional[EngineClient] = None
        self._tokenizer = None
        self._tokenizer_path: Optional[str] = None
        self._connect_lock = threading.Lock()
        self.setup_streams(pb_utils, self.options)
        # Connect (and load the tokenizer) now if the engine is up, so the first request does not wait.
        threading.Thread(target=self._connect_quietly, name="ouro-connect", daemon=True).start()

    def _connect_quietly(self) -> None:
        try:
            self.engine(timeout_s=self.options.engine_connect_timeout_s)
        except EngineProcessError as e:
            log.warning("%s: %s (requests will retry)", self.model_name, e)

    def engine(self, timeout_s: float = 0.0) -> EngineClient:
        """The connection to the engine process; (re)connects when there is none. Requests that come
        while the start-up connect is still waiting for the engine queue on the lock behind it."""
        client = self._client
        if client is not None and not client.closed:
            return client
        with self._connect_lock:
            if self._client is None or self._client.closed:
                client = EngineClient.connect(self.address, self.on_engine_message, self.on_engine_closed,
                                              timeout_s=timeout_s)
                if client.info.model_path != self._tokenizer_path:
                    from ..model.tokenizer import load_tokenizer

                    self._tokenizer = load_tokenizer(client.info.model_path)
                    self._tokenizer_path = client.info.model_path
                self._client = client
                self.pb.Logger.log_info(f"{self.model_name}: connected to the engine process {client.info.pid} "
                                        f"of {self.options.engine_model} ({client.info.model_path})")
            return self._client

    def parse(self, request: Any) -> tuple[protocol.ParsedRequest, list[int], str]:
        inputs = tensor_arrays(self.pb.get_input_tensor_by_name, request, protocol.CLIENT_INPUTS)
        protocol.check_parameters(request.parameters(), self.model_name)
        parsed = protocol.parse_request(inputs, specs=protocol.CLIENT_INPUTS, model=self.model_name)
        self.engine()  # the tokenizer comes with the connection
        ids = protocol.tokenize_arrays(self._tokenizer, parsed.prompt)["input_ids"].reshape(-1).tolist()
        return parsed, ids, f"{self.model_name}-{uuid.uuid4().hex}"

    def response_arrays(self, fields: dict) -> dict:
        return protocol.client_response_arrays(self._tokenizer, **fields)

    def count_error(self) -> None:
        """The metrics live in `ouro_engine`: the engine process counts this error for it."""
        client = self._client
        if client is not None and not client.closed:
            try:
                client.count_error()
            except EngineProcessError:
                pass

    def finalize(self) -> None:
        self.close_streams(f"{self.model_name}: the model is being unloaded")
        client = getattr(self, "_client", None)
        if client is not None:
            client.close()  # the engine process aborts this connection's requests
