"""Strict loading (and saving) of HF-layout Ouro checkpoints: config.json, safetensors, generation_config.json.

Strict on purpose: a missing, extra or misshaped tensor is a wrong model, not something to paper over, so
every error names the tensor, the file and the expected vs found shape.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..config import ConfigError, OuroConfig

PathLike = str | os.PathLike
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Non-persistent buffers some exporters write anyway; recomputed from the config, never trusted.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ConfigError):
    """A checkpoint directory that cannot be used (missing files, wrong tensors). A ConfigError, so a
    caller that reports config problems reports these too."""


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None


def _model_dir(model_dir: PathLike) -> Path:
    d = Path(model_dir).expanduser()
    if not d.is_dir():
        raise CheckpointError(f"model directory {d} does not exist (or is not a directory)")
    return d


def load_config(model_dir: PathLike) -> OuroConfig:
    path = _model_dir(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path} not found: not a Hugging Face model directory")
    return OuroConfig.from_dict(_read_json(path))  # ConfigError for unsupported values


def read_eos_ids(model_dir: PathLike, cfg: OuroConfig) -> list[int]:
    """generation_config.json wins (HF generate() uses it), then config.json, then <|endoftext|>=0."""
    path = _model_dir(model_dir) / "generation_config.json"
    eos: Any = _read_json(path).get("eos_token_id") if path.is_file() else None
    if eos is None or eos == []:
        eos = list(cfg.eos_token_id) or [0]
    ids = [int(e) for e in (eos if isinstance(eos, list) else [eos])]
    return list(dict.fromkeys(ids))  # de-duplicated, order kept


def expected_shapes(cfg: OuroConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of an Ouro checkpoint (docs/model.md) and its shape, in checkpoint order."""
    V, H, I = cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, H)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (cfg.q_size, H),
                p + "self_attn.k_proj.weight": (cfg.kv_size, H),
                p + "self_attn.v_proj.weight": (cfg.kv_size, H),
                p + "self_attn.o_proj.weight": (H, cfg.q_size),
                p + "mlp.gate_proj.weight": (I, H),
                p + "mlp.up_proj.weight": (I, H),
                p + "mlp.down_proj.weight": (H, I),
            }
        )
        for norm in ("input_layernorm", "input_layernorm_2", "post_attention_layernorm", "post_attention_layernorm_2"):
            shapes[p + norm + ".weight"] = (H,)
    shapes.update(
        {
            "model.norm.weight": (H,),
            "model.early_exit_gate.weight": (1, H),
            "model.early_exit_gate.bias": (1,),
            "lm_head.weight": (V, H),
        }
    )
    return shapes


def _weight_files(d: Path) -> dict[str, list[str]]:
    """file name -> tensor names the index says it holds (the single file: checked against itself)."""
    index = d / INDEX_FILE
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: no 'weight_map'")
        files: dict[str, list[str]] = {}
        for name, fname in weight_map.items():
            files.setdefault(fname, []).append(name)
        return files
    if (d / SINGLE_FILE).is_file():
        return {SINGLE_FILE: []}  # names come from the file itself
    raise CheckpointError(f"no weights in {d}: expected {SINGLE_FILE} or {INDEX_FILE}")


def load_weights(
    model_dir: PathLike, cfg: OuroConfig, dtype: torch.dtype, device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    d = _model_dir(model_dir)
    expected = expected_shapes(cfg)
    weights: dict[str, torch.Tensor] = {}
    for fname, indexed in _weight_files(d).items():
        path = d / fname
        if not path.is_file():
            raise CheckpointError(f"weight file {path} (listed in {INDEX_FILE}) not found")
        try:
            with safe_open(str(path), framework="pt") as f:
                names = list(f.keys())
                for name in indexed:
                    if name not in names and not name.endswith(_IGNORED_SUFFIXES):
                        raise CheckpointError(f"{path}: tensor {name!r} is listed in {INDEX_FILE} but missing")
                for name in names:
                    if name.endswith(_IGNORED_SUFFIXES):
                        continue
                    if name not in expected:
                        raise CheckpointError(f"{path}: unexpected tensor {name!r} (not an Ouro weight)")
                    if name in weights:
                        raise CheckpointError(f"{path}: tensor {name!r} appears in more than one file")
                    shape = tuple(f.get_slice(name).get_shape())  # header only: check before reading
                    if shape != expected[name]:
                        raise CheckpointError(
                            f"{path}: tensor {name!r} has shape {list(shape)}, "
                            f"expected {list(expected[name])} for this config.json"
                        )
                    weights[name] = f.get_tensor(name).to(device=device, dtype=dtype)
        except CheckpointError:
            raise
        except (OSError, SafetensorError) as e:  # corrupt header, truncated file (not e.g. a CUDA OOM)
            raise CheckpointError(f"cannot read {path}: {e}") from None
    missing = [n for n in expected if n not in weights]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"{d}: missing tensor(s) {', '.join(missing[:5])}{more}")
    return {name: weights[name] for name in expected}  # checkpoint order, whatever the file order


def _tokenizer_text(tok: Any) -> str:
    if hasattr(tok, "to_str"):  # a tokenizers.Tokenizer
        return tok.to_str()
    if isinstance(tok, str) and tok.lstrip().startswith("{"):  # the JSON itself
        return tok
    return Path(tok).read_text(encoding="utf-8")


def save_checkpoint(
    model_dir: PathLike,
    cfg: OuroConfig,
    weights: Mapping[str, torch.Tensor],
    tokenizer: Any,
    generation_config: dict | None = None,
    shard_size_bytes: int | None = None,
) -> Path:
    """Write an HF-layout checkpoint. `weights` is read one tensor at a time (in its iteration order), and a
    shard is written as soon as it is full, so a lazy mapping keeps memory to about one shard."""
    d = Path(model_dir).expanduser()
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    (d / "tokenizer.json").write_text(_tokenizer_text(tokenizer), encoding="utf-8")
    if generation_config is None and cfg.eos_token_id:
        generation_config = {"bos_token_id": cfg.bos_token_id, "eos_token_id": list(cfg.eos_token_id)}
    if generation_config is not None:
        (d / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")
    for stale in [d / SINGLE_FILE, d / INDEX_FILE, *d.glob("model-*.safetensors")]:
        stale.unlink(missing_ok=True)  # never leave a mix of old and new weights

    shards: list[list[str]] = []
    shard: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        nonlocal shard, size
        if shard:
            path = d / f"model-{len(shards) + 1:05d}.tmp"
            save_file(shard, str(path), metadata={"format": "pt"})
            path.chmod(0o644)  # safetensors creates 0600: a shared model dir must be readable by others
            shards.append(list(shard))
            shard, size = {}, 0

    for name in weights:
        t = weights[name].detach().to("cpu").contiguous()
        nbytes = t.numel() * t.element_size()
        if shard_size_bytes and shard and size + nbytes > shard_size_bytes:
            flush()
        shard[name] = t
        size += nbytes
        total += nbytes
    flush()
    if not shard_size_bytes or len(shards) == 1:
        os.replace(d / "model-00001.tmp", d / SINGLE_FILE)
        return d
    weight_map = {}
    for i, names in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        os.replace(d / f"model-{i:05d}.tmp", d / fname)
        weight_map.update(dict.fromkeys(names, fname))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (d / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return d
