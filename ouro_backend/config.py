"""Typed configuration: the checkpoint's model config and the engine's options, validated in one place.

Every bad value raises `ConfigError` naming the field, so a Triton model load or a CLI run fails with a
message a user can act on.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from dataclasses import dataclass
from typing import Any

MAX_DEFERRED_INTERVAL = 64  # the longest deep chunk (deferred_deep_interval): positions retained per request


class ConfigError(ValueError):
    """A bad checkpoint config or engine option."""


class KVLayout(str, enum.Enum):
    LAST_EXITED = "last_exited"  # one KV plane per loop depth; exits fill the deeper planes
    SHARED = "shared"  # one plane per token: the KV of the token's last (exit) loop


class ExitMode(str, enum.Enum):
    OURO = "ouro"  # the trained gate, decision applied at once
    OURO_DELAYED = "ouro_delayed"  # the gate's decision after loop r applies after loop r+1
    RANDOM_LOOKAHEAD = "random_lookahead"  # seeded untrained gate meaning "one more loop, then exit"
    TRACE = "trace"  # replay per-request depth lists (benchmarks, tests)
    FIXED = "fixed"  # always max_loops


def _enum(cls, value: Any, name: str):
    try:
        return cls(value.lower() if isinstance(value, str) else value)
    except ValueError:
        choices = ", ".join(m.value for m in cls)
        raise ConfigError(f"{name}={value!r} is not supported; choose one of: {choices}") from None


# Config keys of HF Ouro checkpoints that we implement with a fixed meaning; a value other than the one
# given here changes the model math, so it is rejected instead of silently ignored.
_FIXED_KEYS = {
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "rope_scaling": None,
}


@dataclass(frozen=True)
class OuroConfig:
    """The model math an Ouro checkpoint's `config.json` fixes (docs/model.md)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    total_ut_steps: int
    early_exit_threshold: float
    torch_dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()

    @property
    def num_loops(self) -> int:
        """How many times a token runs the layer stack at full depth (the checkpoint's `total_ut_steps`)."""
        return self.total_ut_steps

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> OuroConfig:
        if d.get("model_type") != "ouro":
            raise ConfigError(f"config.json: model_type must be 'ouro', got {d.get('model_type')!r}")
        for key, allowed in _FIXED_KEYS.items():
            if key in d and d[key] != allowed and not (allowed is None and d[key] in (None, 0)):
                raise ConfigError(f"config.json: {key}={d[key]!r} is not supported (only {allowed!r})")
        # Qwen-style configs carry a window size even when `use_sliding_window` is false: only a window that
        # is in force (or one without that switch) changes the attention.
        if d.get("use_sliding_window") is not False and d.get("sliding_window") not in (None, 0):
            raise ConfigError(f"config.json: sliding_window={d['sliding_window']!r} is not supported")
        required = [
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "max_position_embeddings",
            "rms_norm_eps",
        ]
        missing = [k for k in required if k not in d]
        if missing:
            raise ConfigError(f"config.json: missing required field(s): {', '.join(missing)}")
        heads = int(d["num_attention_heads"])
        kv_heads = int(d.get("num_key_value_heads") or heads)
        head_dim = int(d.get("head_dim") or d["hidden_size"] // heads)
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        cfg = cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=int(d["max_position_embeddings"]),
            rope_theta=float(d.get("rope_theta", 10000.0)),
            rms_norm_eps=float(d["rms_norm_eps"]),
            total_ut_steps=int(d.get("total_ut_steps", 4)),
            early_exit_threshold=float(d.get("early_exit_threshold", 1.0)),
            torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "bfloat16"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos_ids,
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
            "total_ut_steps",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"config.json: {name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"config.json: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"config.json: head_dim must be even for RoPE, got {self.head_dim}")
        if not 0.0 <= self.early_exit_threshold <= 1.0:
            raise ConfigError(f"config.json: early_exit_threshold must be in [0, 1], got {self.early_exit_threshold}")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["eos_token_id"] = list(self.eos_token_id)
        d.update(
            model_type="ouro",
            architectures=["OuroForCausalLM"],
            hidden_act="silu",
            tie_word_embeddings=False,
            rope_scaling=None,
            attention_bias=False,
        )
        return d


DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flash")
MODEL_PATH_ENV = "OURO_MODEL_PATH"


@dataclass
class EngineConfig:
    """Engine options. Construct, then `validate()` (the engine does) to get clear errors.

    `model` may be None: then $OURO_MODEL_PATH, else the demo model (ouro_backend.models).
    """

    model: str | None = None
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    kv_layout: str = KVLayout.LAST_EXITED.value
    block_size: int = 16
    num_blocks: int | None = None  # explicit KV size; None: automatic (CUDA) or from kv_cache_bytes
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float = 0.90
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: min(max_position_embeddings, 8192)
    prefill_chunk_size: int | None = None  # None: max_num_batched_tokens
    exit_mode: str = ExitMode.OURO.value
    exit_threshold: float | None = None  # None: the checkpoint's early_exit_threshold
    attention_backend: str = "auto"
    eos_token_ids: list[int] | None = None  # None: generation_config.json / config.json
    seed: int = 0  # seeds random_lookahead's gate and unseeded sampling
    cuda_graphs: bool = True  # capture the recurrent core per row/token bucket (CUDA + triton backend)
    # Rounds with more prompt tokens than this run eagerly (docs/engine.md, "CUDA graphs").
    cuda_graph_max_tokens: int = 2048
    # Launch N+1 before reading launch N's tokens back, so host work overlaps the GPU (docs/engine.md).
    # Exits are decided on the device, so no round waits for the host. False: every launch is read back
    # before the next one (a debugging switch; the same code otherwise).
    async_scheduling: bool = True
    # Decode rounds per launch when no prompt work is pending and nobody waits: one CUDA graph replays
    # them back to back, so the host's launch and bookkeeping are paid once per launch. 1: one a launch.
    decode_rounds_per_launch: int = 4
    cpu_kv_cache_bytes: int = 256 << 20  # KV budget on CPU when num_blocks/kv_cache_bytes are unset
    # KV blocks are taken as each request's frontier advances (docs/kv-memory.md). Admission leaves this
    # share of the cache free for running requests to grow into.
    kv_watermark: float = 0.01
    # When running requests need blocks that are not free, the newest are preempted. recompute: their blocks
    # are freed and they are prefilled again later, each generated token at its recorded exit depth (exact
    # under last_exited); swap: their KV and decode rows wait in host memory, up to swap_space_gib in all
    # (exact under both layouts; when it is full, recompute). auto: recompute for last_exited, swap for shared.
    preemption_mode: str = "auto"
    # Share full prompt blocks between requests by content (docs/kv-memory.md); last_exited only. None: on
    # under last_exited, off under shared.
    enable_prefix_caching: bool | None = None
    swap_space_gib: float = 4.0
    # Self-speculative decoding (docs/engine.md): the first `spec_draft_loops` loops draft `spec_tokens`
    # tokens, the remaining loops verify them in one pass; greedy output equals plain full-depth decoding.
    # 0: off. It verifies at full depth, so it needs kv_layout=last_exited and requests without gate exits.
    spec_tokens: int = 0
    spec_draft_loops: int = 1
    # Automatic fallback: speculate only while the cost model says it pays (speculation.SpecPolicy);
    # false: speculate on every decode launch without prompt work.
    spec_auto: bool = True
    spec_max_verify_tokens: int = 256  # larger verify passes are compute-bound: decode without drafts
    # Deferred deep batching (docs/engine.md), for rollout throughput: B > 0 reads tokens out at loop
    # `deferred_readout_loop` (r) and runs loops r+1..T only at every B-th token, over the request's last B
    # positions in one chunk; that token is read out at loop T. 0: off. 1 is full depth.
    deferred_deep_interval: int = 0
    deferred_readout_loop: int = 2
    # The eager same-readout control: the same readout (loop r, loop T at every B-th token), with loops
    # r+1..T run for every token as it comes. Same tokens as deferred, for measuring its batching gain.
    deferred_deep_eager: bool = False
    # Serving limits, enforced by the Triton models in front of the engine process (serving/streams.py): a
    # request still unfinished this many seconds after it arrived ends with a timeout error (0: no limit;
    # a smaller Triton request `timeout` wins); at most this many requests wait beyond the max_num_seqs
    # running ones, and more are refused at once as busy (Triton UNAVAILABLE, HTTP 503).
    request_timeout_s: float = 600.0
    max_waiting_requests: int = 256

    def resolved_model_path(self) -> str | None:
        return self.model or os.environ.get(MODEL_PATH_ENV) or None

    def validate(self) -> EngineConfig:
        self.kv_layout = _enum(KVLayout, self.kv_layout, "kv_layout").value
        self.exit_mode = _enum(ExitMode, self.exit_mode, "exit_mode").value
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype={self.dtype!r} is not supported; choose one of: {', '.join(DTYPES)}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(
                f"attention_backend={self.attention_backend!r} is not supported; "
                f"choose one of: {', '.join(ATTENTION_BACKENDS)}"
            )
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ConfigError(f"device={self.device!r} is not supported; use auto, cpu, cuda or cuda:N")
        positive = ["block_size", "max_num_seqs", "max_num_batched_tokens"]
        positive += ["cuda_graph_max_tokens", "decode_rounds_per_launch", "spec_max_verify_tokens", "spec_draft_loops"]
        for name in positive + ["num_blocks", "kv_cache_bytes", "max_model_len", "prefill_chunk_size"]:
            value = getattr(self, name)
            if value is None and name not in positive:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.enable_prefix_caching is not None and not isinstance(self.enable_prefix_caching, bool):
            raise ConfigError(f"enable_prefix_caching must be true, false or unset, got {self.enable_prefix_caching!r}")
        if self.enable_prefix_caching and self.kv_layout == KVLayout.SHARED.value:
            raise ConfigError(
                "enable_prefix_caching needs kv_layout=last_exited: the shared layout keeps only the "
                "last plane of a prompt, and a new request's prefill needs every plane of its prefix"
            )
        if self.preemption_mode not in ("auto", "recompute", "swap"):
            raise ConfigError(
                f"preemption_mode={self.preemption_mode!r} is not supported; choose auto, recompute or swap"
            )
        if not 0.0 <= self.kv_watermark < 1.0:
            raise ConfigError(f"kv_watermark must be in [0, 1), got {self.kv_watermark}")
        if not (isinstance(self.request_timeout_s, (int, float)) and self.request_timeout_s >= 0.0):
            raise ConfigError(f"request_timeout_s must be >= 0 (0: no limit), got {self.request_timeout_s!r}")
        if (
            isinstance(self.max_waiting_requests, bool)
            or not isinstance(self.max_waiting_requests, int)
            or self.max_waiting_requests < 0
        ):
            raise ConfigError(f"max_waiting_requests must be an integer >= 0, got {self.max_waiting_requests!r}")
        if not self.swap_space_gib >= 0.0:
            raise ConfigError(f"swap_space_gib must be >= 0, got {self.swap_space_gib}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.exit_threshold is not None and not 0.0 <= self.exit_threshold <= 1.0:
            raise ConfigError(f"exit_threshold must be in [0, 1], got {self.exit_threshold}")
        if self.prefill_chunk_size and self.prefill_chunk_size > self.max_num_batched_tokens:
            raise ConfigError(
                f"prefill_chunk_size ({self.prefill_chunk_size}) cannot exceed "
                f"max_num_batched_tokens ({self.max_num_batched_tokens})"
            )
        K = self.spec_tokens
        if isinstance(K, bool) or not isinstance(K, int) or not 0 <= K <= 32:
            raise ConfigError(f"spec_tokens must be an integer in [0, 32] (0: no speculation), got {K!r}")
        if self.spec_tokens:
            if self.kv_layout != KVLayout.LAST_EXITED.value:
                raise ConfigError(
                    "spec_tokens > 0 needs kv_layout=last_exited: under the shared layout a draft "
                    "would read its context's exit-loop KV, which verification has not written yet"
                )
            if self.exit_mode == ExitMode.TRACE.value:
                raise ConfigError(
                    "spec_tokens > 0 cannot serve exit_mode=trace: speculation verifies every token at full depth"
                )
            if self.exit_threshold is not None and self.exit_threshold < 1.0:
                raise ConfigError(
                    f"spec_tokens > 0 verifies at full depth; exit_threshold={self.exit_threshold} "
                    f"would ask for gate exits (use 1.0, or spec_tokens=0)"
                )
        self._validate_deferred_deep()
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_num_seqs ({self.max_num_seqs}): every running sequence needs a row"
            )
        return self

    def _validate_deferred_deep(self) -> None:
        """What deferred deep batching combines with; the readout loop is checked against the model's loops
        by the engine."""
        B, r = self.deferred_deep_interval, self.deferred_readout_loop
        if isinstance(B, bool) or not isinstance(B, int) or not 0 <= B <= MAX_DEFERRED_INTERVAL:
            raise ConfigError(
                f"deferred_deep_interval must be an integer in [0, {MAX_DEFERRED_INTERVAL}] (0: off), got {B!r}"
            )
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise ConfigError(f"deferred_readout_loop must be a positive integer, got {r!r}")
        if not isinstance(self.deferred_deep_eager, bool):
            raise ConfigError(f"deferred_deep_eager must be true or false, got {self.deferred_deep_eager!r}")
        if not B:
            if self.deferred_deep_eager:
                raise ConfigError("deferred_deep_eager needs deferred_deep_interval > 0")
            return
        if self.max_num_batched_tokens < B:
            raise ConfigError(
                f"deferred_deep_interval ({B}) cannot exceed max_num_batched_tokens ({self.max_num_batched_tokens}): "
                f"a deep chunk of B positions runs in one round"
            )
        why = "deferred_deep_interval > 0 fixes every token's depth (loop r, loop T at every B-th token)"
        if self.kv_layout != KVLayout.LAST_EXITED.value:
            raise ConfigError(f"{why} and writes true per-loop KV: it needs kv_layout=last_exited")
        if self.spec_tokens:
            raise ConfigError(f"{why}; it does not combine with speculation (spec_tokens={self.spec_tokens})")
        if self.exit_mode != ExitMode.OURO.value or (self.exit_threshold is not None and self.exit_threshold < 1.0):
            raise ConfigError(
                f"{why}; gate exits do not combine with it: leave exit_mode=ouro and exit_threshold unset or 1.0"
            )
        if self.preemption_mode != "auto":
            raise ConfigError(
                f"{why}; it reserves each request's whole KV at admission, so nothing is preempted: "
                f"leave preemption_mode=auto (got {self.preemption_mode!r})"
            )

    @property
    def prefix_caching(self) -> bool:
        """Whether prompt blocks are shared: the option, or by default wherever the layout allows it."""
        if self.enable_prefix_caching is None:
            return self.kv_layout == KVLayout.LAST_EXITED.value
        return self.enable_prefix_caching

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_strings(cls, values: dict[str, str]) -> EngineConfig:
        """Build from string options (Triton `parameters`, CLI); unknown keys are an error."""
        types = {f.name: f.type for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, raw in values.items():
            if key not in types:
                raise ConfigError(f"unknown engine option {key!r}; known options: {', '.join(cls.field_names())}")
            kwargs[key] = parse_value(key, str(raw).strip(), str(types[key]))
        return cls(**kwargs).validate()


def parse_value(key: str, raw: str, type_name: str, what: str = "engine option") -> Any:
    """A string option -> the dataclass field's type (`type_name` as written in the annotation)."""
    if raw == "" or raw.lower() in ("none", "null"):
        if "None" in type_name or "Optional" in type_name:  # `X | None` (or Optional[X]): unset
            return None
        raise ConfigError(f"{what} {key} needs a value")
    try:
        if "list[int]" in type_name:
            return [int(x) for x in raw.replace(",", " ").split()]
        if "int" in type_name:
            return int(raw)
        if "float" in type_name:
            return float(raw)
        if "bool" in type_name:
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
    except ValueError:
        raise ConfigError(
            f"{what} {key}={raw!r} is not a valid {type_name.replace(' | None', '').replace('Optional', '')}"
        ) from None
    return raw
