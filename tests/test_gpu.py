"""GPU correctness (run on the device; skipped without CUDA): the Triton backend, with and without CUDA
graphs, against the dense fp32 oracle. fp32: identical greedy tokens. bf16: relative logits error <= 2e-2."""
import pytest
import torch

from ouro_backend import SamplingParams
from test_engine_oracle import PROMPTS, make_engine, ouro_exit, run_all

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
LAYOUTS = ["last_exited", "shared"]


def gpu_engine(toy_path, dtype, **kw):
    return make_engine(toy_path, device="cuda", dtype=dtype, attention_backend="triton", **kw)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("threshold", [1.0, 0.5])
def test_fp32_greedy_equals_oracle(toy_path, oracle, layout, graphs, threshold):
    eng = gpu_engine(toy_path, "float32", kv_layout=layout, cuda_graphs=graphs, prefill_chunk_size=5,
                     max_num_batched_tokens=16)
    eng.runner.record_logits = False  # exercise the graphs' in-graph greedy coda
    outs = run_all(eng, PROMPTS, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                exit_threshold=threshold))
    for prompt, out in zip(PROMPTS, outs):
        tokens, depths = oracle.generate(prompt, 8, exit_fn=ouro_exit(threshold), layout=layout)
        assert (out.token_ids, out.exit_depths) == (tokens, depths)
    if graphs:
        assert eng.runner.graph_rounds > 0 and eng.runner.eager_rounds == 0


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("graphs", [True, False])
def test_bf16_logits_within_tolerance(toy_path, oracle, layout, graphs):
    """Prefill, decode and mixed-depth decode logits of the bf16 engine vs the fp32 oracle, given the
    engine's own tokens and depths (so a bf16 argmax flip cannot derail the comparison)."""
    eng = gpu_engine(toy_path, "bfloat16", kv_layout=layout, cuda_graphs=graphs)
    outs = run_all(eng, PROMPTS, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                                                exit_threshold=0.5))
    worst = 0.0
    depths_seen = set()
    for i, (prompt, out) in enumerate(zip(PROMPTS, outs)):
        seq = prompt + out.token_ids
        loops = [4] * len(prompt) + out.exit_depths[1:] + [4]
        ref = oracle.forward(seq[:-1], len(prompt), loops[: len(seq) - 1], layout)
        for k, got in enumerate(eng.recorded[str(i)]):
            want = ref.logits[len(prompt) - 1 + k]
            worst = max(worst, float((got.float() - want).norm() / want.norm()))
        depths_seen |= set(out.exit_depths[1:])
    assert len(depths_seen) > 1
    assert worst <= 2e-2, worst
    print(f"bf16 {layout} graphs={graphs}: worst relative logits error {worst:.2e}")


def test_seeded_sampling_same_with_and_without_graphs(toy_path):
    params = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True, exit_threshold=0.5)
    outs = [run_all(gpu_engine(toy_path, "float32", cuda_graphs=g), PROMPTS, params) for g in (True, False)]
    assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]
