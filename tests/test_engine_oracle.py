"""The engine against the dense fp32 oracle: prefill logits, greedy decode, early exit, both KV layouts."""

import pytest
import torch
from engine_helpers import ORACLE_PROMPTS as PROMPTS
from engine_helpers import check_exits_against_oracle, ouro_exit, run_all
from engine_helpers import make_recording_engine as make_engine

from ouro_backend import SamplingParams

LAYOUTS = ["last_exited", "shared"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("chunk", [None, 1, 3, 5])
def test_prefill_logits_match_oracle(toy_path, oracle, layout, chunk):
    eng = make_engine(toy_path, kv_layout=layout, prefill_chunk_size=chunk, max_num_batched_tokens=64, max_num_seqs=8)
    run_all(eng, PROMPTS, SamplingParams(max_tokens=1, temperature=0.0))
    for i, prompt in enumerate(PROMPTS):
        ref = oracle.forward(prompt, len(prompt), [4] * len(prompt), layout).logits[-1]
        got = eng.recorded[str(i)][0]
        assert torch.allclose(got, ref, atol=1e-4, rtol=0), (layout, chunk, (got - ref).abs().max())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_greedy_full_depth_matches_oracle(toy_path, oracle, layout):
    eng = make_engine(toy_path, kv_layout=layout, prefill_chunk_size=4, max_num_batched_tokens=16)
    outs = run_all(eng, PROMPTS, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        tokens, depths = oracle.generate(prompt, 6, layout=layout)
        assert out.token_ids == tokens
        assert out.exit_depths == depths == [4] * 6


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("threshold", [0.5, 0.8])
def test_early_exit_mixed_depths_match_oracle(toy_path, oracle, layout, threshold):
    eng = make_engine(toy_path, kv_layout=layout, max_num_batched_tokens=32)
    all_depths = check_exits_against_oracle(eng, oracle, PROMPTS, threshold, layout)
    assert len(all_depths) > 1, "the test needs rows at different depths in one batch"


def test_layouts_differ_under_early_exit(toy_path, oracle):
    """The two KV rules are really different computations (otherwise the tests above prove little)."""
    prompt = PROMPTS[0]
    a = oracle.generate(prompt, 8, exit_fn=ouro_exit(0.5), layout="last_exited")
    b = oracle.generate(prompt, 8, exit_fn=ouro_exit(0.5), layout="shared")
    seq = prompt + a[0]
    loops = [4] * len(prompt) + a[1][1:] + [4]
    la = oracle.forward(seq[:-1], len(prompt), loops[: len(seq) - 1], "last_exited").logits[-1]
    lb = oracle.forward(seq[:-1], len(prompt), loops[: len(seq) - 1], "shared").logits[-1]
    assert (la - lb).abs().max() > 1e-3
    assert a[1] != [4] * 8 and b[1] != [4] * 8


@pytest.mark.parametrize("chunk", [1, 4, 7])
def test_shared_results_independent_of_chunk_size(toy_path, chunk):
    base = make_engine(toy_path, kv_layout="shared")
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, exit_threshold=0.5)
    ref = run_all(base, PROMPTS, params)
    eng = make_engine(toy_path, kv_layout="shared", prefill_chunk_size=chunk, max_num_batched_tokens=16)
    got = run_all(eng, PROMPTS, params)
    for r, g in zip(ref, got):
        assert r.token_ids == g.token_ids and r.exit_depths == g.exit_depths
    for i in range(len(PROMPTS)):
        for a, b in zip(base.recorded[str(i)], eng.recorded[str(i)]):
            assert torch.allclose(a, b, atol=1e-4, rtol=0)


def test_eager_baseline_matches_oracle(toy_weights, oracle):
    """The benchmark's baseline (HF-style eager, concatenated per-loop cache) computes the same model."""
    from ouro_backend.entrypoints.baseline import EagerBaseline

    base = EagerBaseline(*toy_weights)
    prompts = torch.tensor([PROMPTS[0][:10], PROMPTS[2][:10]])
    got = base.generate(prompts, 5)["tokens"]
    for row, prompt in zip(got, prompts.tolist()):
        assert row == oracle.generate(prompt, 5)[0]
