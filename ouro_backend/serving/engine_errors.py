"""The errors an engine process's clients see (engine_client, engine_pool) besides a RequestError."""

from __future__ import annotations

from ..sampling_params import RequestError


class EngineProcessError(RuntimeError):
    """The engine process could not start, is gone, or its socket directory or key is not safe to use."""


class ServerBusy(RequestError):
    """A request refused because the engine already holds as many as it may (EngineInfo.capacity)."""
