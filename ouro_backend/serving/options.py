"""Engine options for the `ouro_engine` Triton model: `config.pbtxt` parameters + environment overrides.

Precedence (later wins):
  1. `parameters { key: "max_num_seqs" value: { string_value: "32" } }` in config.pbtxt
     (empty values and unfilled `${...}` template placeholders count as unset);
  2. $OURO_ENGINE_ARGS: a JSON object `{"max_num_seqs": "8"}` or `key=value` pairs separated by
     commas/whitespace (what `ouro-serve --engine-arg key=value` sets); its serving-layer keys
     (`ServingOptions`) go to the serving layer, and the streaming ones (`StreamOptions`, e.g.
     stream_interval) to the `ouro` front as well (`front_parameters`);
  3. $OURO_MODEL_PATH: the checkpoint directory (overrides the `model` parameter);
  4. $OURO_ENGINE_DEVICES: the engine processes' devices (overrides the `engine_devices` parameter).
If no model is given at all, the engine uses the demo model shipped with the package (ouro_backend.models).
A relative `model` path is resolved against the model's directory in the repository when it exists there.
Unknown keys and bad values fail the model load with ConfigError naming the option.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from ..config import MODEL_PATH_ENV, ConfigError, parse_value

ENGINE_ARGS_ENV = "OURO_ENGINE_ARGS"
DEVICES_ENV = "OURO_ENGINE_DEVICES"  # overrides the `engine_devices` parameter (what `ouro-serve --devices` sets)


def _option(default: Any, help: str) -> Any:
    return dataclasses.field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class StreamOptions:
    """What both decoupled models (`ouro_engine`, `ouro`) take as config.pbtxt parameters."""

    cancel_check_interval_s: float = _option(0.05, "how often open requests are checked for client cancellation")
    response_threads: int = _option(8, "threads sending responses; a request always uses the same one")
    stream_interval: int = _option(
        0,
        "streaming: tokens per response (1: one token per response; 0: a response carries every token "
        "waiting when its sender gets to it, so a busy server coalesces); a request's stream_interval input "
        "overrides it",
    )

    def validate(self):
        if self.stream_interval < 0:
            raise ConfigError(f"stream_interval={self.stream_interval!r} must be >= 0")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "stream_interval":
                continue
            if (isinstance(value, str) and not value) or (not isinstance(value, str) and value <= 0):
                raise ConfigError(f"{f.name}={value!r} must be " + ("set" if isinstance(value, str) else "> 0"))
        return self


@dataclass(frozen=True)
class ServingOptions(StreamOptions):
    """`ouro_engine` parameters that configure the serving layer, not the engine."""

    metrics_interval_s: float = _option(0.25, "how often each engine process reports metrics and its load")
    engine_devices: str = _option(
        "auto",
        "one engine process per device, comma-separated (cuda:0,cuda:1; cpu); "
        "auto: every visible GPU, else the CPU ($OURO_ENGINE_DEVICES overrides)",
    )


@dataclass(frozen=True)
class FrontOptions(StreamOptions):
    """`ouro` parameters."""

    engine_model: str = _option("ouro_engine", "the model whose engine process serves this front's requests")
    engine_connect_timeout_s: float = _option(300.0, "how long the front waits at load for that engine to come up")


def option_docs(cls: type) -> list[tuple[str, str]]:
    """(name, "help (default)") for each field of an options dataclass: what config.pbtxt documents."""
    return [
        (
            f.name,
            f"{f.metadata['help']} ({f.default:g})"
            if isinstance(f.default, float)
            else f"{f.metadata['help']} ({f.default})",
        )
        for f in dataclasses.fields(cls)
    ]


# Parameters in config.pbtxt that configure the serving layer, not the engine.
SERVING_KEYS = frozenset({"EXECUTION_ENV_PATH"} | {f.name for f in dataclasses.fields(ServingOptions)})
_O = TypeVar("_O", bound=StreamOptions)


def typed_options(cls: type[_O], values: Mapping[str, str]) -> _O:
    """String parameters -> a validated options dataclass; unknown keys and bad values raise ConfigError."""
    types = {f.name: str(f.type) for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, raw in values.items():
        if key == "EXECUTION_ENV_PATH":
            continue
        if key not in types:
            raise ConfigError(f"unknown parameter {key!r}; known: {', '.join(sorted(types))}")
        kwargs[key] = parse_value(key, str(raw).strip(), types[key], what="parameter")
    return cls(**kwargs).validate()


def parse_engine_args(raw: str | None) -> dict[str, str]:
    """$OURO_ENGINE_ARGS -> {key: value}."""
    if not raw or not raw.strip():
        return {}
    raw = raw.strip()
    if raw.startswith("{"):
        try:
            d = json.loads(raw)
        except ValueError as e:
            raise ConfigError(f"${ENGINE_ARGS_ENV} is not valid JSON: {e}") from None
        if not isinstance(d, dict):
            raise ConfigError(f"${ENGINE_ARGS_ENV} must be a JSON object")
        return {str(k): "" if v is None else str(v) for k, v in d.items()}
    out = {}
    for item in raw.replace(",", " ").split():
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"${ENGINE_ARGS_ENV}: {item!r} is not key=value")
        out[key.strip()] = value.strip()
    return out


def model_config_parameters(model_config: Mapping[str, Any]) -> dict[str, str]:
    """config.pbtxt `parameters` (as in the JSON model config Triton hands to initialize) -> {key: str}."""
    out = {}
    for key, value in (model_config.get("parameters") or {}).items():
        v = value.get("string_value", "") if isinstance(value, Mapping) else str(value)
        v = str(v).strip()
        if v == "" or (v.startswith("${") and v.endswith("}")):
            continue
        out[key] = v
    return out


def engine_options(
    model_config: Mapping[str, Any], model_dir: str | None = None, environ: Mapping[str, str] | None = None
) -> tuple[dict[str, str], dict[str, str]]:
    """(engine options for EngineConfig.from_strings, serving options)."""
    env = os.environ if environ is None else environ
    params = model_config_parameters(model_config)
    serving = {k: v for k, v in params.items() if k in SERVING_KEYS}
    options = {k: v for k, v in params.items() if k not in SERVING_KEYS}
    for k, v in parse_engine_args(env.get(ENGINE_ARGS_ENV)).items():
        (serving if k in SERVING_KEYS else options)[k] = v
    if env.get(DEVICES_ENV):
        serving["engine_devices"] = env[DEVICES_ENV]
    if env.get(MODEL_PATH_ENV):
        options["model"] = env[MODEL_PATH_ENV]
    model = options.get("model")
    if model:
        model = os.path.expanduser(model)
        if not os.path.isabs(model) and model_dir and os.path.isdir(os.path.join(model_dir, model)):
            model = os.path.join(model_dir, model)
        options["model"] = model
    return options, serving


STREAM_KEYS = frozenset(f.name for f in dataclasses.fields(StreamOptions))


def front_parameters(model_config: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The `ouro` front's parameters: config.pbtxt's, then the streaming keys of $OURO_ENGINE_ARGS (what
    `ouro-serve --engine-arg stream_interval=1` sets for both decoupled models)."""
    env = os.environ if environ is None else environ
    params = model_config_parameters(model_config)
    params.update({k: v for k, v in parse_engine_args(env.get(ENGINE_ARGS_ENV)).items() if k in STREAM_KEYS})
    return params


def resolve_model_path(options: dict[str, str]) -> dict[str, str]:
    """Fill in the default model (the shipped demo model) when no model is configured."""
    if not options.get("model"):
        from ..models import default_model

        options = dict(options, model=default_model())
    elif not os.path.isdir(options["model"]):
        raise ConfigError(
            f"model={options['model']!r}: no such checkpoint directory "
            f"(set the `model` parameter in config.pbtxt, ${MODEL_PATH_ENV}, or ouro-serve --model)"
        )
    return options


def decoupled_model_config(pb_utils: Any, args: dict, default_name: str) -> tuple[dict, str]:
    """A Python model's parsed config.pbtxt and name; refuses a config without the decoupled policy."""
    config = json.loads(args["model_config"])
    name = args.get("model_name", default_name)
    if not pb_utils.using_decoupled_model_transaction_policy(config):
        raise pb_utils.TritonModelException(
            f"{name}: set `model_transaction_policy {{ decoupled: true }}` in config.pbtxt"
        )
    return config, name


def tensor_arrays(tensors: Iterable[Any], names: Container[str]) -> dict:
    """The numpy arrays of those `tensors` (a request's ``inputs()``) whose name is among `names`.
    NOTE one pass over the tensors, each name read once (``pb_utils.get_input_tensor_by_name`` walks
    ``inputs()`` once per name it is asked for)."""
    return {name: t.as_numpy() for t in tensors if (name := t.name()) in names}
