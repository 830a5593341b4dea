"""ouro_backend: an inference engine for Ouro looped language models, built to be served by Triton.

The names below are imported on first use: the serving models (the `ouro` front, pre/postprocessing) and
the clients' tracing import submodules of this package without loading torch and the engine."""

import importlib
from typing import Any

_EXPORTS = {
    "LLM": "engine.llm_engine",
    "LLMEngine": "engine.llm_engine",
    "EngineConfig": "config",
    "SamplingParams": "sampling_params",
    "RequestOutput": "outputs",
    "OuroConfig": "config",
    "KVLayout": "config",
    "ExitMode": "config",
    "ConfigError": "config",
    "RequestError": "sampling_params",
}
__all__ = list(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value
