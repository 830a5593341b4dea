"""ouro_backend: an inference engine for Ouro looped language models, built to be served by Triton."""
from .config import ConfigError, EngineConfig, ExitMode, KVLayout, OuroConfig
from .engine.llm_engine import LLM, LLMEngine
from .outputs import RequestOutput
from .sampling_params import RequestError, SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "OuroConfig",
           "KVLayout", "ExitMode", "ConfigError", "RequestError"]
__version__ = "0.1.0"
