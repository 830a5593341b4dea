"""Bad input: a clear exception naming the problem, and the engine keeps serving everyone else."""

import json
import shutil

import pytest
from engine_helpers import ORACLE_PROMPTS as PROMPTS
from engine_helpers import make_recording_engine as make_engine
from engine_helpers import run_all

from ouro_backend import ConfigError, EngineConfig, LLMEngine, RequestError, SamplingParams


@pytest.fixture(scope="module")
def engine(toy_path):
    return make_engine(toy_path, max_model_len=64)


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ("", {}, "prompt is empty"),
        ([], {}, "prompt is empty"),
        ([1] * 64, {}, "context limit"),
        ([1] * 40, dict(max_tokens=30), "exceeds the context limit"),
        ([5, 100000], {}, "outside the vocabulary"),
        ([5, -1], {}, "outside the vocabulary"),
    ],
)
def test_bad_prompts(engine, prompt, params, match):
    with pytest.raises(RequestError, match=match):
        engine.add_request("bad", prompt, SamplingParams(**params))


@pytest.mark.parametrize(
    "params, match",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-3), "max_tokens"),
        (dict(min_loops=3, max_loops=2), "min_loops"),
        (dict(exit_threshold=1.5), "exit_threshold"),
        (dict(exit_threshold=-0.1), "exit_threshold"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.2), "top_p"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_k=-2), "top_k"),
        (dict(seed=-1), "seed"),
        (dict(min_tokens=20, max_tokens=5), "min_tokens"),
    ],
)
def test_bad_sampling_params(params, match):
    with pytest.raises(RequestError, match=match):
        SamplingParams(**params)


def test_loops_beyond_model(engine):
    with pytest.raises(RequestError, match="max_loops"):
        engine.add_request("x", PROMPTS[0], SamplingParams(max_loops=5))


def test_engine_keeps_serving_after_bad_requests(engine):
    for bad in ("", [10**6]):
        with pytest.raises(RequestError):
            engine.add_request("dup", bad, SamplingParams())
    out = run_all(engine, [PROMPTS[1]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4
    engine.add_request("same", PROMPTS[1], SamplingParams(max_tokens=2))
    with pytest.raises(RequestError, match="already in use"):
        engine.add_request("same", PROMPTS[1], SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.parametrize(
    "opts, match",
    [
        (dict(exit_mode="sometimes"), "exit_mode"),
        (dict(kv_layout="diagonal"), "kv_layout"),
        (dict(dtype="int8"), "dtype"),
        (dict(block_size=0), "block_size"),
        (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
        (dict(exit_threshold=2.0), "exit_threshold"),
        (dict(attention_backend="magic"), "attention_backend"),
    ],
)
def test_bad_engine_options(opts, match):
    with pytest.raises(ConfigError, match=match):
        EngineConfig(**opts).validate()


def test_engine_options_from_strings():
    cfg = EngineConfig.from_strings({"max_num_seqs": "8", "exit_threshold": "0.5", "eos_token_ids": "0,2"})
    assert cfg.max_num_seqs == 8 and cfg.exit_threshold == 0.5 and cfg.eos_token_ids == [0, 2]
    with pytest.raises(ConfigError, match="unknown engine option 'max_seqs'"):
        EngineConfig.from_strings({"max_seqs": "8"})
    with pytest.raises(ConfigError, match="max_num_seqs"):
        EngineConfig.from_strings({"max_num_seqs": "many"})


def _broken_copy(toy_path, tmp_path, edit):
    d = tmp_path / "ckpt"
    shutil.copytree(toy_path, d)
    edit(d)
    return str(d)


def test_checkpoint_missing_tensor(toy_path, tmp_path):
    from safetensors.torch import load_file, save_file

    def drop(d):
        w = load_file(d / "model.safetensors")
        del w["model.layers.1.mlp.up_proj.weight"]
        save_file(w, d / "model.safetensors")

    with pytest.raises(ConfigError, match="model.layers.1.mlp.up_proj.weight"):
        LLMEngine(EngineConfig(model=_broken_copy(toy_path, tmp_path, drop), device="cpu"))


def test_checkpoint_misshaped_tensor(toy_path, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    def reshape(d):
        w = load_file(d / "model.safetensors")
        w["model.norm.weight"] = torch.ones(3)
        save_file(w, d / "model.safetensors")

    with pytest.raises(ConfigError, match="model.norm.weight"):
        LLMEngine(EngineConfig(model=_broken_copy(toy_path, tmp_path, reshape), device="cpu"))


def test_checkpoint_unsupported_config(toy_path, tmp_path):
    def rope_scaling(d):
        cfg = json.loads((d / "config.json").read_text())
        cfg["rope_scaling"] = {"type": "linear", "factor": 2.0}
        (d / "config.json").write_text(json.dumps(cfg))

    with pytest.raises(ConfigError, match="rope_scaling"):
        LLMEngine(EngineConfig(model=_broken_copy(toy_path, tmp_path, rope_scaling), device="cpu"))


def test_flash_backend_unavailable_is_a_clear_error(toy_path):
    with pytest.raises(ConfigError, match="attention_backend=flash"):
        LLMEngine(EngineConfig(model=toy_path, device="cpu", attention_backend="flash"))
