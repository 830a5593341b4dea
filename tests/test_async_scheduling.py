"""Asynchronous scheduling (round N+1 launched before round N's tokens are read back) computes exactly what
synchronous rounds compute: same tokens, depths, logprobs and finish reasons, nothing leaked."""

import pytest
import torch
from engine_helpers import ORACLE_PROMPTS as PROMPTS
from engine_helpers import make_recording_engine as make_engine

from ouro_backend import SamplingParams

WORKLOAD = [  # (prompt, params): greedy and seeded sampling, gate and trace exits, EOS and stop-token stops
    (PROMPTS[0], SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)),
    (PROMPTS[1], SamplingParams(max_tokens=9, temperature=0.9, seed=7, ignore_eos=True, exit_threshold=0.5)),
    (PROMPTS[2], SamplingParams(max_tokens=12, temperature=0.0, exit_threshold=0.6)),  # EOS may stop it
    (
        PROMPTS[0][:5],
        SamplingParams(max_tokens=11, temperature=0.0, ignore_eos=True, exit_threshold=1.0, exit_trace=[1, 3, 2, 4]),
    ),
    (PROMPTS[1] * 3, SamplingParams(max_tokens=10, temperature=1.1, top_k=20, seed=3, ignore_eos=True)),
]


CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"))


def run(toy_path, async_scheduling, workload, eos=None, device="cpu", **kw):
    if device == "cuda":  # fp32 Triton kernels with CUDA graphs (decode rounds carry the in-graph coda)
        kw.update(device="cuda", attention_backend="triton")
    eng = make_engine(toy_path, async_scheduling=async_scheduling, eos_token_ids=eos, **kw)
    eng.runner.record_logits = False
    for i, (prompt, params) in enumerate(workload):
        eng.add_request(str(i), prompt, params)
    outs, steps_to_first = {}, None
    steps = 0
    while eng.has_unfinished_requests():
        step_outs = eng.step()
        steps += 1
        if step_outs and steps_to_first is None:
            steps_to_first = steps
        for o in step_outs:
            if o.finished:
                outs[o.request_id] = o
    assert eng.kv.pool.num_available == eng.kv.num_blocks, "KV blocks leaked"
    assert eng._in_flight is None
    return [outs[str(i)] for i in range(len(workload))], steps_to_first


def summary(o):
    return o.token_ids, o.exit_depths, o.finish_reason


def assert_same(a, b):
    """Tokens, depths and finish reasons identical; logprobs to fp32 rounding (the CPU's matmuls round
    differently for different numbers of rows, and a launch's row count depends on when the host learns
    that a request ended)."""
    assert [summary(o) for o in a] == [summary(o) for o in b]
    for x, y in zip(a, b):
        assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-4, rtol=0)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("exit_mode", ["ouro", "trace"])
def test_async_equals_sync(toy_path, exit_mode, device):
    sync, first_sync = run(toy_path, False, WORKLOAD, exit_mode=exit_mode, device=device)
    asyn, first_async = run(toy_path, True, WORKLOAD, exit_mode=exit_mode, device=device)
    assert_same(asyn, sync)
    assert first_async == first_sync + 1, "async outputs should come one step later"


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_stop_on_token_drops_the_extra_round(toy_path, device):
    """A request that stops on EOS had its next token's round launched already: that work is dropped, the
    output ends at EOS, and its KV is freed."""
    ref, _ = run(toy_path, False, WORKLOAD[:1], device=device)
    eos = ref[0].token_ids[4]
    # The workload's first request stops at the first occurrence of `eos` once EOS counts.
    stop_at = ref[0].token_ids.index(eos) + 1
    workload = [(PROMPTS[0], SamplingParams(max_tokens=14, temperature=0.0))] + WORKLOAD[1:2]
    sync, _ = run(toy_path, False, workload, eos=[eos], device=device)
    asyn, _ = run(toy_path, True, workload, eos=[eos], device=device)
    assert asyn[0].finish_reason == "stop" and asyn[0].token_ids == ref[0].token_ids[:stop_at]
    assert_same(asyn, sync)


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_a_one_token_request_runs_its_prompt_and_no_decode_round(toy_path, device):
    """max_tokens 1: the token comes from the prompt's last loop, so no decode round is launched behind it
    (asynchronous scheduling plans the next launch before that token is back). Alone: exactly its prompt's
    loops; beside a longer request: the same outputs as synchronous rounds."""
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    kw = dict(device="cuda", attention_backend="triton") if device == "cuda" else {}
    eng = make_engine(toy_path, async_scheduling=True, **kw)
    eng.runner.record_logits = False
    launches = eng.counters["steps"]
    eng.add_request("a", PROMPTS[0], one)
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert eng.counters["steps"] - launches == eng.runner.model.cfg.num_loops  # one launch a prompt loop
    assert outs[-1].finish_reason == "length"
    assert len(outs[-1].token_ids) == 1 and eng.kv.pool.num_available == eng.kv.num_blocks
    workload = [(PROMPTS[0], one), WORKLOAD[0], (PROMPTS[2], one)]
    sync, _ = run(toy_path, False, workload, device=device)
    asyn, _ = run(toy_path, True, workload, device=device)
    assert_same(asyn, sync)


def test_abort_with_a_round_in_flight(toy_path):
    eng = make_engine(toy_path, async_scheduling=True)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, exit_threshold=1.0)
    eng.add_request("a", PROMPTS[0], params)
    eng.add_request("b", PROMPTS[1], params)
    seen = {"a": 0, "b": 0}
    while seen["a"] < 3:
        for o in eng.step():
            seen[o.request_id] += len(o.new_token_ids)
    assert eng._in_flight is not None  # a launch that advances "a" is out on the device
    eng.abort_request("a")
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs.setdefault(o.request_id, []).append(o)
    assert outs["a"][-1].finish_reason == "abort" and len(outs["a"]) == 1  # nothing after the abort
    assert outs["b"][-1].finish_reason == "length" and len(outs["b"][-1].token_ids) == 30
    assert eng.kv.pool.num_available == eng.kv.num_blocks
