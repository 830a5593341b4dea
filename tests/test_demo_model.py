"""The shipped demo model (docs/demo-model.md): the default checkpoint, English that a word list knows, a
gate that varies the depth, loss that falls with depth, and exact agreement with the dense oracle."""

import json
from pathlib import Path

import pytest
import torch
from engine_helpers import check_exits_against_oracle
from engine_helpers import make_recording_engine as make_engine
from helpers import ouro_serve_cmd, read_until_ready

from ouro_backend import LLM, SamplingParams
from ouro_backend.model.checkpoint import load_config, load_weights
from ouro_backend.model.oracle import DenseOracle
from ouro_backend.model.tokenizer import load_tokenizer
from ouro_backend.models import DEMO_MODEL
from ouro_backend.train.evaluate import WORD_LIST, english_report, heldout_report, load_word_list

HELDOUT = Path(__file__).parent / "data" / "demo_heldout.txt"  # paragraphs of the corpus's held-out split


@pytest.fixture(scope="module")
def english():
    if not Path(WORD_LIST).is_file():  # scripts/setup.sh installs Debian's wamerican
        pytest.fail(f"{WORD_LIST} is missing: apt-get install wamerican")
    return english_report(None, load_word_list())  # None: the default model


def test_demo_model_is_the_default_and_a_real_checkpoint():
    llm = LLM(device="cpu", dtype="float32")
    assert Path(llm.engine.model_path) == DEMO_MODEL
    size = sum(f.stat().st_size for f in DEMO_MODEL.glob("*.safetensors"))
    assert size <= 25e6, f"weights are {size / 1e6:.1f} MB"
    cfg = load_config(DEMO_MODEL)
    assert cfg.total_ut_steps == 4 and cfg.early_exit_threshold == 1.0
    tok = load_tokenizer(DEMO_MODEL)
    assert [tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]
    assert tok.get_vocab_size() == cfg.vocab_size


def test_greedy_continuations_are_english(english):
    assert english["known_words"] >= 0.75, english
    for prompt, runs in english["prompts"].items():
        for name, r in runs.items():
            assert r["printable"], (prompt, name, r["text"])
            assert r["text"].strip(), (prompt, name)
            # Not one phrase over and over (a sentence said twice is 0.5; three times about 0.67).
            assert r["repeated_share"] < 0.6, (prompt, name, r["text"])


def test_gate_varies_the_depth_token_by_token(english):
    depths = [d for runs in english["prompts"].values() for d in runs["gate 0.7"]["exit_depths"]]
    assert len(set(depths)) > 1, english["gate_depth_histogram"]
    full = [d for runs in english["prompts"].values() for d in runs["full"]["exit_depths"]]
    assert set(full) == {4}


def test_heldout_loss_falls_with_depth_and_gate_exits_lose_little():
    r = heldout_report(str(DEMO_MODEL), HELDOUT.read_text(encoding="utf-8"))
    ce = r["ce_per_loop"]
    assert ce[0] > ce[1] > ce[2] and ce[3] <= ce[2] + 0.02, ce
    assert r["gate"]["0.7"]["ce_vs_full"] < 0.02, r["gate"]
    assert 1.0 < r["gate"]["0.5"]["mean_depth"] < 4.0
    agree = r["agreement_with_last_loop"]
    assert 0.3 < agree[1] < agree[2] < agree[3] < 1.0, agree  # draft quality rises with the draft's depth
    # Deferred deep batching's readout: B = 1 is full depth; a longer interval reads out at loop 2 more often,
    # so its loss moves from full depth's towards loop 2's.
    deferred = r["deferred_readout"]["intervals"]
    assert deferred["1"]["ce"] == ce[3] and deferred["1"]["mean_depth"] == 4.0
    losses = [deferred[b]["ce"] for b in ("1", "4", "8", "16")]
    assert losses == sorted(losses) and losses[-1] < ce[1], (losses, ce)
    assert abs(deferred["4"]["mean_depth"] - 2.5) < 0.01


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
def test_engine_matches_dense_oracle_with_exits(layout):
    cfg = load_config(DEMO_MODEL)
    oracle = DenseOracle(cfg, load_weights(DEMO_MODEL, cfg, torch.float32, "cpu"))
    tok = load_tokenizer(DEMO_MODEL)
    prompts = [tok.encode(p).ids for p in ("Once upon a time, there was a little", "The weather today is")]
    eng = make_engine(str(DEMO_MODEL), kv_layout=layout, max_num_batched_tokens=32)
    # The demo gate exits at loop 3 often enough at 0.5 for mixed depths in one batch.
    depths_seen = check_exits_against_oracle(eng, oracle, prompts, 0.5, layout)
    assert len(depths_seen) > 1, depths_seen


def test_training_model_computes_the_oracle_model():
    """LoopedLM (what training optimises) is the model the engine serves: same logits and gates as the
    dense oracle on the shipped weights, at every loop."""
    from ouro_backend.train.looped_lm import LoopedLM

    cfg = load_config(DEMO_MODEL)
    weights = load_weights(DEMO_MODEL, cfg, torch.float32, "cpu")
    model = LoopedLM(cfg).eval()
    model.load_state_dict(weights, strict=True)
    ids = load_tokenizer(DEMO_MODEL).encode("It is a truth universally acknowledged").ids
    with torch.no_grad():
        states, gate_logits = model(torch.tensor([ids]))
    ref = DenseOracle(cfg, weights).forward(ids, len(ids), [4] * len(ids))
    for i in range(len(ids)):
        for t in range(4):
            assert torch.allclose(states[t][0, i], ref.hidden[i][t], atol=1e-5), (i, t)
            assert abs(float(torch.sigmoid(gate_logits[t, 0, i])) - ref.gates[i][t]) < 1e-6
        assert torch.allclose(model.lm_head(states[-1][0, i]), ref.logits[i], atol=1e-4)


def test_exit_distribution_is_the_gate_cdf():
    from ouro_backend.train.looped_lm import exit_distribution

    z = torch.tensor([[-2.0, 0.5, 40.0], [1.0, -1.0, 40.0], [0.0, 3.0, 40.0], [5.0, 5.0, 5.0]])
    lam = torch.sigmoid(z)
    want = torch.stack(
        [
            lam[0],
            (1 - lam[0]) * lam[1],
            (1 - lam[0]) * (1 - lam[1]) * lam[2],
            (1 - lam[0]) * (1 - lam[1]) * (1 - lam[2]),
        ]
    )
    assert torch.allclose(exit_distribution(z), want, atol=1e-6)
    assert torch.allclose(exit_distribution(z).sum(0), torch.ones(3))
    z.requires_grad_(True)  # a saturated gate (lambda = 1.0 in fp32) keeps finite gradients
    exit_distribution(z)[3].sum().backward()
    assert torch.isfinite(z.grad).all()


def test_training_writes_a_checkpoint_the_engine_serves(tmp_path):
    """A few steps of the real training loop on a tiny corpus and model: the output loads and generates."""
    from ouro_backend.train.train import TrainOptions, train

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    text = HELDOUT.read_text(encoding="utf-8")
    (corpus / "train.txt").write_text(text)
    (corpus / "heldout.txt").write_text(text[:4000])
    o = TrainOptions(
        steps=3,
        batch=2,
        seq_len=32,
        eval_every=3,
        warmup=1,
        vocab_size=512,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
    )
    train(corpus, tmp_path / "model", o, torch.device("cpu"))
    out = LLM(model=str(tmp_path / "model"), device="cpu", dtype="float32").generate(
        ["Once upon a time"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    )[0]
    assert len(out.token_ids) == 4
    log = (tmp_path / "model" / "training_log.jsonl").read_text().splitlines()
    assert len(log) == 2 and len(json.loads(log[1])["heldout"]["ce_per_loop"]) == 4


def test_ouro_serve_without_a_model_serves_the_demo_model(tmp_path):
    """The first command a user runs: `ouro-serve` with no model, then a plain HTTP generate call. The real
    launcher and tritonserver; the served text is the offline engine's greedy text."""
    import os
    import signal
    import subprocess
    import urllib.request

    from ouro_backend.entrypoints.tritonserver import ServerError, find_tritonserver, free_port

    try:
        find_tritonserver()
    except ServerError as e:
        pytest.skip(f"no tritonserver available: {e}")
    http = free_port()
    env = {k: v for k, v in os.environ.items() if k != "OURO_MODEL_PATH"}
    proc = subprocess.Popen(
        ouro_serve_cmd(None, str(tmp_path / "server.log"), http, free_port(), free_port()),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        out = read_until_ready(proc, tmp_path / "server.log", timeout=300)
        assert f"serving the demo model {DEMO_MODEL}" in out
        prompt = "Once upon a time, there was a little"
        body = json.dumps(
            {"text_input": prompt, "max_tokens": 24, "temperature": 0, "exclude_input_in_output": True}
        ).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{http}/v2/models/ouro/generate", data=body, headers={"Content-Type": "application/json"}
        )
        served = json.loads(urllib.request.urlopen(req, timeout=120).read())["text_output"]
        offline = (
            LLM(device="cpu", dtype="float32")
            .generate([prompt], SamplingParams(max_tokens=24, temperature=0.0))[0]
            .text
        )
        assert served == offline and served.strip(), (served, offline)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
