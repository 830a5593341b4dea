import json
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from ouro_backend.config import ConfigError
from ouro_backend.model.checkpoint import (
    CheckpointError,
    expected_shapes,
    load_config,
    load_weights,
    read_eos_ids,
    save_checkpoint,
)
from ouro_backend.model.tokenizer import load_tokenizer
from ouro_backend.model.toy import (
    LazyWeights,
    build_tokenizer_json,
    ensure_toy_checkpoint,
    toy_config,
    write_checkpoint,
)


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("toy") / "ck")


@pytest.fixture()
def copy(toy, tmp_path) -> Path:
    return Path(shutil.copytree(toy, tmp_path / "copy"))


def edit_config(d: Path, **changes) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def test_expected_shapes_toy_and_1p4b():
    s = expected_shapes(toy_config("toy"))
    assert len(s) == 1 + 2 * 11 + 4
    assert s["model.layers.1.self_attn.q_proj.weight"] == (64, 64)
    assert s["model.layers.1.self_attn.k_proj.weight"] == (32, 64)  # GQA: 2 kv heads * 16
    assert s["model.layers.0.self_attn.o_proj.weight"] == (64, 64)
    assert s["model.layers.0.mlp.down_proj.weight"] == (64, 160)
    assert s["model.layers.0.post_attention_layernorm_2.weight"] == (64,)
    assert s["model.early_exit_gate.weight"] == (1, 64) and s["model.early_exit_gate.bias"] == (1,)
    big = expected_shapes(toy_config("ouro-1.4b"))
    assert sum(torch.Size(v).numel() for v in big.values()) == 1_434_652_673  # embed+head+24 layers+gate
    assert len(expected_shapes(toy_config("ouro-2.6b"))) == 1 + 48 * 11 + 4


def test_toy_round_trip(toy):
    cfg = load_config(toy)
    assert cfg == toy_config("toy")
    assert (cfg.vocab_size, cfg.num_key_value_heads, cfg.total_ut_steps, cfg.torch_dtype) == (1024, 2, 4, "float32")
    w = load_weights(toy, cfg, torch.float32)
    assert list(w) == list(expected_shapes(cfg))
    ref = LazyWeights(cfg, seed=0, tokenizer_vocab=load_tokenizer(toy).get_vocab_size())
    for name, t in w.items():
        assert t.dtype == torch.float32 and torch.equal(t, ref[name]), name
    assert w["model.early_exit_gate.bias"].item() == -0.25
    tok = load_tokenizer(toy)
    assert 500 < tok.get_vocab_size() <= cfg.vocab_size
    assert w["lm_head.weight"][tok.get_vocab_size() :].abs().sum() == 0  # padding rows
    assert read_eos_ids(toy, cfg) == [0, 2]
    bf = load_weights(toy, cfg, torch.bfloat16)
    assert bf["lm_head.weight"].dtype == torch.bfloat16
    assert torch.equal(bf["lm_head.weight"], w["lm_head.weight"].to(torch.bfloat16))


def test_sharded_round_trip(toy, tmp_path):
    d = write_checkpoint(tmp_path / "sharded", shards=3)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert not (d / "model.safetensors").exists()
    cfg = load_config(d)
    single, sharded = load_weights(toy, cfg, torch.float32), load_weights(d, cfg, torch.float32)
    assert list(sharded) == list(single) and all(torch.equal(single[k], sharded[k]) for k in single)
    # a shard the index names must exist
    (d / files[1]).unlink()
    with pytest.raises(CheckpointError, match=files[1]):
        load_weights(d, cfg, torch.float32)


def test_save_checkpoint_shard_size_and_tokenizer_forms(toy, tmp_path):
    cfg = load_config(toy)
    w = load_weights(toy, cfg, torch.float32)
    d = save_checkpoint(tmp_path / "s", cfg, w, toy / "tokenizer.json", shard_size_bytes=200_000)
    n = len(set(json.loads((d / "model.safetensors.index.json").read_text())["weight_map"].values()))
    assert n >= 4
    assert all(torch.equal(a, b) for a, b in zip(load_weights(d, cfg, torch.float32).values(), w.values()))
    assert json.loads((d / "generation_config.json").read_text())["eos_token_id"] == [0, 2]
    # re-saving as a single file removes the old shards (no mix of old and new weights)
    save_checkpoint(d, cfg, w, load_tokenizer(toy))
    assert sorted(p.name for p in d.glob("*.safetensors")) == ["model.safetensors"]
    assert (d / "tokenizer.json").read_text() == load_tokenizer(toy).to_str()


def test_deterministic(toy, tmp_path):
    again = write_checkpoint(tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json", "config.json", "generation_config.json"):
        assert (again / name).read_bytes() == (toy / name).read_bytes(), name
    other = write_checkpoint(tmp_path / "seed1", seed=1)
    assert (other / "model.safetensors").read_bytes() != (toy / "model.safetensors").read_bytes()
    # tokenizer training is deterministic across processes too (Rust hash maps are randomly seeded)
    out = subprocess.run(
        [sys.executable, "-c", "from ouro_backend.model.toy import build_tokenizer_json as b; print(b(), end='')"],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).parents[1],
    )
    assert out.stdout == build_tokenizer_json() == (toy / "tokenizer.json").read_text()


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_config(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="config.json"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{broken")
    with pytest.raises(CheckpointError, match="cannot read"):
        load_config(tmp_path)


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(model_type="llama"), "model_type must be 'ouro'"),
        (dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling"),
        (dict(tie_word_embeddings=True), "tie_word_embeddings"),
        (dict(use_sliding_window=True, sliding_window=4096), "sliding_window"),
        (dict(sliding_window=4096), "sliding_window"),
        (dict(num_key_value_heads=3), "multiple of num_key_value_heads"),
    ],
)
def test_unsupported_config(copy, changes, match):
    edit_config(copy, **changes)
    with pytest.raises(ConfigError, match=match):
        load_config(copy)


def test_missing_tensor(copy):
    cfg = load_config(copy)
    w = load_weights(copy, cfg, torch.float32)
    del w["model.layers.1.input_layernorm_2.weight"]
    save_checkpoint(copy, cfg, w, copy / "tokenizer.json")
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) model\.layers\.1\.input_layernorm_2\.weight"):
        load_weights(copy, cfg, torch.float32)


def test_misshaped_tensor(copy):
    cfg = load_config(copy)
    w = load_weights(copy, cfg, torch.float32)
    w["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(64, 64)  # MHA-shaped k for a GQA config
    save_checkpoint(copy, cfg, w, copy / "tokenizer.json")
    with pytest.raises(CheckpointError) as e:
        load_weights(copy, cfg, torch.float32)
    msg = str(e.value)
    assert "model.layers.0.self_attn.k_proj.weight" in msg and "model.safetensors" in msg
    assert "[64, 64]" in msg and "expected [32, 64]" in msg


def test_unexpected_tensor_and_ignored_buffers(copy):
    cfg = load_config(copy)
    w = load_weights(copy, cfg, torch.float32)
    w["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)  # old exporters write these: ignored
    save_checkpoint(copy, cfg, w, copy / "tokenizer.json")
    assert "model.layers.0.self_attn.rotary_emb.inv_freq" not in load_weights(copy, cfg, torch.float32)
    w["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    save_checkpoint(copy, cfg, w, copy / "tokenizer.json")
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.q_norm\.weight'"):
        load_weights(copy, cfg, torch.float32)


def test_corrupt_weights(copy):
    data = (copy / "model.safetensors").read_bytes()
    (copy / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="cannot read .*model.safetensors"):
        load_weights(copy, load_config(copy), torch.float32)


def test_no_weights(copy):
    (copy / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_weights(copy, load_config(copy), torch.float32)


def test_eos_ids(copy):
    cfg = load_config(copy)
    (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert read_eos_ids(copy, cfg) == [2]
    (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0, 2]}))
    assert read_eos_ids(copy, cfg) == [2, 0]
    (copy / "generation_config.json").unlink()
    assert read_eos_ids(copy, cfg) == [0, 2]  # config.json's
    edit_config(copy, eos_token_id=None)
    assert read_eos_ids(copy, load_config(copy)) == [0]  # <|endoftext|>


def test_ensure_toy_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("OURO_CACHE_DIR", str(tmp_path / "cache"))
    results: list[str] = []
    threads = [threading.Thread(target=lambda: results.append(ensure_toy_checkpoint())) for _ in range(3)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    path = tmp_path / "cache" / "toy"
    assert results == [str(path)] * 3
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["toy"]  # no temp dirs left behind
    cfg = load_config(path)
    assert cfg == toy_config("toy") and len(load_weights(path, cfg, torch.float32)) == 27
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_toy_checkpoint() == str(path)
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime  # cached, not rebuilt
    (path / "TOY_VERSION").write_text("0\n")  # a toy from an older version is replaced
    assert ensure_toy_checkpoint() == str(path)
    assert (path / "TOY_VERSION").read_text().strip() != "0"
    assert ensure_toy_checkpoint(tmp_path / "explicit") == str(tmp_path / "explicit")
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="not a toy checkpoint"):  # never deletes a user's directory
        ensure_toy_checkpoint(tmp_path / "real")
    assert (tmp_path / "real" / "config.json").read_text() == "{}"


def test_inactive_sliding_window_is_accepted(copy):
    """Qwen-style configs name a window size with use_sliding_window false: that is plain full attention."""
    edit_config(copy, use_sliding_window=False, sliding_window=4096)
    assert load_config(copy).num_hidden_layers > 0
