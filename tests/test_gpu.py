"""GPU correctness (run on the device; skipped without CUDA): the Triton backend, with and without CUDA
graphs and with several decode rounds per launch, against the dense fp32 oracle. fp32: identical greedy
tokens and exit depths in every exit mode. bf16: relative logits error <= 2e-2."""

import gc

import pytest
import torch
from engine_helpers import ORACLE_PROMPTS as PROMPTS
from engine_helpers import make_recording_engine as make_engine
from engine_helpers import ouro_exit, run_all

from ouro_backend import SamplingParams
from ouro_backend.engine import cuda_graphs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
LAYOUTS = ["last_exited", "shared"]


@pytest.fixture(autouse=True)
def projections_through_the_kernel(monkeypatch, request):
    """Every decode projection of the toy model through `kernels.projections.linear` (its measured table
    covers only the real shapes), except in tests marked ``cublas``."""
    monkeypatch.setenv("OURO_LINEAR", "cublas" if request.node.get_closest_marker("cublas") else "kernel")


@pytest.fixture(autouse=True)
def release_gpu_memory():
    """Each engine captures dozens of graphs; free them before the next test's captures."""
    yield
    gc.collect()
    torch.cuda.empty_cache()


def gpu_engine(toy_path, dtype, **kw):
    return make_engine(toy_path, device="cuda", dtype=dtype, attention_backend="triton", **kw)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("threshold", [1.0, 0.5])
@pytest.mark.parametrize("rounds", [1, 4])
def test_fp32_greedy_equals_oracle(toy_path, oracle, layout, graphs, threshold, rounds):
    eng = gpu_engine(
        toy_path,
        "float32",
        kv_layout=layout,
        cuda_graphs=graphs,
        prefill_chunk_size=5,
        max_num_batched_tokens=16,
        decode_rounds_per_launch=rounds,
    )
    eng.runner.record_logits = False  # exercise the graphs' in-graph coda and multi-round launches
    outs = run_all(
        eng, PROMPTS, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, exit_threshold=threshold)
    )
    for prompt, out in zip(PROMPTS, outs):
        tokens, depths = oracle.generate(prompt, 8, exit_fn=ouro_exit(threshold), layout=layout)
        assert (out.token_ids, out.exit_depths) == (tokens, depths)
    if graphs:
        assert eng.stats()["graph_launches"] > 0 and eng.stats()["eager_launches"] == 0
    if rounds > 1:
        assert eng.stats()["rounds"] > eng.stats()["launches"], "no launch ran several rounds"
    assert eng.stats()["host_syncs"] == 0


@pytest.mark.cublas
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp32_greedy_equals_oracle_with_cublas_projections(toy_path, oracle, layout):
    eng = gpu_engine(toy_path, "float32", kv_layout=layout, decode_rounds_per_launch=4)
    outs = run_all(eng, PROMPTS, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, exit_threshold=0.5))
    for prompt, out in zip(PROMPTS, outs):
        assert (out.token_ids, out.exit_depths) == oracle.generate(prompt, 8, exit_fn=ouro_exit(0.5), layout=layout)


def delayed_exit(threshold, min_loops=1, max_loops=4):
    def fn(gates):
        return min(ouro_exit(threshold, min_loops, max_loops)(gates) + 1, max_loops)

    return fn


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", ["ouro", "ouro_delayed"])
@pytest.mark.parametrize("few_rows", [None, 4])
def test_fp32_mixed_requests_staggered_equal_oracle(toy_path, oracle, monkeypatch, layout, mode, few_rows):
    """Per-request thresholds and loop bounds in one batch, arriving at different steps, with graphs and
    four rounds per launch: every request's tokens and depths equal the oracle's. few_rows=4: mixed graphs
    beside 4 bound rows as well (the engine's 8 slots are fewer than FEW_ROWS)."""
    if few_rows is not None:
        monkeypatch.setattr(cuda_graphs, "FEW_ROWS", few_rows)
    eng = gpu_engine(
        toy_path,
        "float32",
        kv_layout=layout,
        exit_mode=mode,
        decode_rounds_per_launch=4,
        prefill_chunk_size=5,
        max_num_batched_tokens=16,
    )
    eng.runner.record_logits = False
    replay_mixed, few_replays = eng.runner._replay_mixed, []

    def counting_replay(graph, batch, h):
        few_replays.append(graph.rows < eng.runner.graphs.max_rows)
        return replay_mixed(graph, batch, h)

    eng.runner._replay_mixed = counting_replay
    specs = [(0.5, 1, 4), (0.8, 2, 4), (0.3, 1, 3), (1.0, 1, 4), (0.6, 3, 4)]
    rule = ouro_exit if mode == "ouro" else delayed_exit
    outs = {}
    for step in range(10_000):
        if step % 3 == 0 and step // 3 < len(specs):
            i = step // 3
            thr, lo, hi = specs[i]
            eng.add_request(
                str(i),
                PROMPTS[i % 3],
                SamplingParams(
                    max_tokens=7 + i, temperature=0.0, ignore_eos=True, exit_threshold=thr, min_loops=lo, max_loops=hi
                ),
            )
        if not eng.has_unfinished_requests() and len(outs) == len(specs):
            break
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
    for i, (thr, lo, hi) in enumerate(specs):
        tokens, depths = oracle.generate(PROMPTS[i % 3], 7 + i, exit_fn=rule(thr, lo, hi), layout=layout)
        assert (outs[str(i)].token_ids, outs[str(i)].exit_depths) == (tokens, depths), (mode, i)
    assert eng.kv.pool.num_available == eng.kv.num_blocks
    assert eng.stats()["eager_launches"] == 0
    assert any(few_replays) == (few_rows is not None), few_replays


def test_fp32_trace_and_max_tokens_mid_launch(toy_path):
    """Trace depths replayed on the device; max_tokens reached inside a 4-round launch stops exactly."""
    eng = gpu_engine(toy_path, "float32", exit_mode="trace", decode_rounds_per_launch=4)
    traces = [[1, 3, 2, 4], [2], [4, 1]]
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, exit_trace=t) for n, t in zip((9, 5, 6), traces)
    ]
    outs = run_all(eng, PROMPTS, params)
    for out, trace, p in zip(outs, traces, params):
        assert len(out.token_ids) == p.max_tokens and out.finish_reason == "length"
        assert out.exit_depths == [4] + [trace[k % len(trace)] for k in range(p.max_tokens - 1)]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("graphs", [True, False])
def test_bf16_logits_within_tolerance(toy_path, oracle, layout, graphs):
    """Prefill, decode and mixed-depth decode logits of the bf16 engine vs the fp32 oracle, given the
    engine's own tokens and depths (so a bf16 argmax flip cannot derail the comparison)."""
    eng = gpu_engine(toy_path, "bfloat16", kv_layout=layout, cuda_graphs=graphs)
    outs = run_all(eng, PROMPTS, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, exit_threshold=0.5))
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
    """Seeded tokens are the same with graphs, without, with several rounds a launch, and alone."""
    params = SamplingParams(
        max_tokens=10, temperature=0.9, top_p=0.9, top_k=50, seed=11, ignore_eos=True, exit_threshold=0.5
    )
    runs = [
        run_all(gpu_engine(toy_path, "float32", cuda_graphs=g, decode_rounds_per_launch=r), PROMPTS, params)
        for g, r in ((True, 4), (True, 1), (False, 1))
    ]
    alone = run_all(gpu_engine(toy_path, "float32"), PROMPTS[1:2], params)
    for outs in runs[1:]:
        assert [(o.token_ids, o.exit_depths) for o in outs] == [(o.token_ids, o.exit_depths) for o in runs[0]]
    assert (alone[0].token_ids, alone[0].exit_depths) == (runs[0][1].token_ids, runs[0][1].exit_depths)


@pytest.mark.parametrize("K,d", [(4, 1), (7, 3)])
def test_fp32_speculation_equals_oracle(toy_path, oracle, K, d):
    """Self-speculation on the Triton backend (the verify pass is a varlen causal chunk over paged KV):
    greedy tokens equal the oracle's full-depth decoding; graphs on for plain launches, 4 rounds a launch."""
    eng = gpu_engine(
        toy_path, "float32", spec_tokens=K, spec_draft_loops=d, prefill_chunk_size=5, max_num_batched_tokens=16
    )
    eng.runner.record_logits = False
    outs = run_all(eng, PROMPTS, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == oracle.generate(prompt, 12)[0]
    assert eng.stats()["spec_steps"] > 0


def test_fp32_sampled_speculation_equals_plain_sampling(toy_path):
    """Coupled sampling inside the speculative graphs: seeded sampled tokens equal a plain engine's."""
    params = [
        SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=5 + i, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]
    plain = run_all(gpu_engine(toy_path, "float32"), PROMPTS, params)
    eng = gpu_engine(toy_path, "float32", spec_tokens=4, spec_draft_loops=2, spec_auto=False)
    eng.runner.record_logits = False
    spec = run_all(eng, PROMPTS, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert eng.stats()["spec_steps"] > 0 and eng.stats()["graph_launches"] > 0


@pytest.mark.parametrize("layout, mode", [("last_exited", "recompute"), ("last_exited", "swap"), ("shared", "swap")])
def test_fp32_preemption_with_graphs_equals_runs_alone(toy_path, layout, mode):
    """A cache that holds half of what 8 requests grow to: blocks grow under CUDA graphs and multi-round
    launches, requests are preempted (recomputed at their exit depths, or swapped out) and resumed, and
    each one's tokens and depths equal its run alone."""
    from test_kv_memory import NUM_BLOCKS, params
    from test_kv_memory import PROMPTS as KV_PROMPTS

    eng = gpu_engine(
        toy_path, "float32", kv_layout=layout, num_blocks=NUM_BLOCKS[layout], exit_threshold=0.5, preemption_mode=mode
    )
    eng.runner.record_logits = False
    outs = run_all(eng, KV_PROMPTS, [params(i, 0.5, False) for i in range(len(KV_PROMPTS))])
    st = eng.stats()
    assert st["num_preemptions"] > 0 and st["graph_launches"] > 0
    assert st["kv_blocks_free"] == st["kv_blocks_total"] and st["num_swapped"] == 0
    big = gpu_engine(toy_path, "float32", kv_layout=layout, exit_threshold=0.5)  # 512 blocks: no preemption
    big.runner.record_logits = False
    for i, (prompt, out) in enumerate(zip(KV_PROMPTS, outs)):
        ref = run_all(big, [prompt], [params(i, 0.5, False)])[0]  # each request alone
        assert (out.token_ids, out.exit_depths) == (ref.token_ids, ref.exit_depths), f"request {i}"


# (repetition, presence, frequency) sets that change the toy model's greedy output (test_penalties.py)
PENALTIES = [(0.5, 1.0, 0.0), (0.6, 0.0, 2.0), (1.0, -2.0, 0.0), (0.7, -1.0, 0.5)]


def _penalized(pen, **kw):
    kw = dict(dict(max_tokens=8, temperature=0.0, ignore_eos=True, exit_threshold=1.0), **kw)
    return SamplingParams(repetition_penalty=pen[0], presence_penalty=pen[1], frequency_penalty=pen[2], **kw)


@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("rounds", [1, 4])
def test_fp32_penalties_equal_oracle_under_graphs(toy_path, oracle, graphs, rounds):
    """SamplerMode.PENALIZE inside the decode and mixed graphs (fused decode-state kernels, counts kept on
    the device over multi-round launches): every penalized request's greedy tokens equal the oracle's with
    the penalties, its unpenalized batch mates equal plain decoding, with no eager launch and no host sync."""
    eng = gpu_engine(
        toy_path,
        "float32",
        cuda_graphs=graphs,
        prefill_chunk_size=5,
        max_num_batched_tokens=16,
        decode_rounds_per_launch=rounds,
        max_num_seqs=16,
    )
    eng.runner.record_logits = False
    plain = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, exit_threshold=1.0)
    reqs = [(p, _penalized(pen)) for pen in PENALTIES for p in PROMPTS] + [(p, plain) for p in PROMPTS]
    outs = run_all(eng, [r[0] for r in reqs], [r[1] for r in reqs])
    for (prompt, params), out in zip(reqs, outs):
        pen = (params.repetition_penalty, params.presence_penalty, params.frequency_penalty)
        assert out.token_ids == oracle.generate(prompt, 8, penalties=pen if params.penalized else None)[0], pen
    st = eng.stats()
    if graphs:
        assert st["graph_launches"] > 0 and st["eager_launches"] == 0
    if rounds > 1:
        assert st["rounds"] > st["launches"]
    assert st["host_syncs"] == 0


def test_penalized_seeded_sampling_and_logprobs_same_with_and_without_graphs(toy_path):
    """Seeded penalized sampling (mixed with unpenalized requests) draws the same tokens with graphs (one
    and four rounds a launch) and without, and a request alone; the logprobs handed out with the tokens
    (SamplingParams.logprobs) add up to the final output's."""
    params = [
        _penalized(pen, temperature=0.5, seed=21 + i, top_k=40 if i % 2 else 0, logprobs=True)
        for i, pen in enumerate(PENALTIES)
    ] + [SamplingParams(max_tokens=8, temperature=0.8, seed=3, ignore_eos=True, logprobs=True)]
    prompts = [PROMPTS[i % 3] for i in range(len(params))]

    def run(eng):
        eng.runner.record_logits = False
        for i, (p, sp) in enumerate(zip(prompts, params)):
            eng.add_request(str(i), p, sp)
        streamed, final = {}, {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                streamed.setdefault(o.request_id, []).extend(o.new_logprobs)
                if o.finished:
                    final[o.request_id] = o
        for rid, o in final.items():
            assert streamed[rid] == o.logprobs and len(o.logprobs) == 8
        return [final[str(i)] for i in range(len(params))]

    runs = [
        run(gpu_engine(toy_path, "float32", cuda_graphs=g, decode_rounds_per_launch=r))
        for g, r in ((True, 4), (True, 1), (False, 1))
    ]
    for outs in runs[1:]:
        assert [o.token_ids for o in outs] == [o.token_ids for o in runs[0]]
        for a, b in zip(outs, runs[0]):
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    eng = gpu_engine(toy_path, "float32")
    eng.runner.record_logits = False
    alone = run_all(eng, prompts[:1], params[:1])[0]
    assert alone.token_ids == runs[0][0].token_ids


@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("rounds", [1, 4])
@pytest.mark.parametrize("eager", [False, True])
def test_fp32_deferred_deep_equals_its_dense_definition(toy_path, oracle, graphs, rounds, eager):
    """Deferred deep batching (and its eager control) on the device, with graphs and multi-round launches:
    tokens and depths equal the dense definition (tests/test_deferred_deep.py), KV planes to 1e-3."""
    from engine_helpers import drive
    from test_deferred_deep import check_against_reference, record_kv_at_finish

    B = 4
    eng = gpu_engine(
        toy_path,
        "float32",
        cuda_graphs=graphs,
        decode_rounds_per_launch=rounds,
        max_num_batched_tokens=64,
        deferred_deep_interval=B,
        deferred_deep_eager=eager,
    )
    eng.runner.record_logits = False
    kv_seen = record_kv_at_finish(eng)
    from engine_helpers import BATCH_PROMPTS

    lengths = [11, 8, 5, 13, 1, 9]
    requests = [
        (f"r{i}", p, SamplingParams(max_tokens=lengths[i], temperature=0.0, ignore_eos=True))
        for i, p in enumerate(BATCH_PROMPTS[:6])
    ]
    run = drive(eng, requests, arrivals={"r1": 2, "r2": 3, "r3": 7})
    check_against_reference(oracle, run, kv_seen, requests, B, kv_atol=1e-3)
    if graphs:
        assert eng.stats()["graph_launches"] > 0


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode,threshold", [("ouro", 1.0), ("ouro", 0.5), ("ouro_delayed", 0.5)])
def test_fused_greedy_coda_equals_the_plain_coda_and_the_oracle(toy_path, oracle, monkeypatch, layout, mode, threshold):
    """Greedy decode rounds of at most 64 rows run the coda as one kernel (`kernels/coda.py`): its tokens, exit
    depths and logprobs equal those of the plain coda (``OURO_FUSED_CODA=0``: the LM head GEMM, argmax,
    log_softmax) and the oracle's, with graphs and four rounds a launch; the kernel really ran (counted at
    capture). (Put in place directly: ``OURO_FUSED_CODA=0`` would leave the backend without it.)"""
    from ouro_backend.kernels import backend, coda

    calls = []
    fused = coda.greedy_coda

    def counting(*a, **kw):
        calls.append(a[0].shape[0])
        return fused(*a, **kw)

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, exit_threshold=threshold, logprobs=True)
    runs = []
    for kernel in (counting, None):
        monkeypatch.setattr(backend.TritonBackend, "greedy_coda", staticmethod(kernel) if kernel else None)
        eng = gpu_engine(toy_path, "float32", kv_layout=layout, exit_mode=mode, decode_rounds_per_launch=4)
        eng.runner.record_logits = False
        runs.append(run_all(eng, PROMPTS, params))
        assert eng.stats()["graph_launches"] > 0 and eng.stats()["host_syncs"] == 0
    assert calls and max(calls) <= backend.TritonBackend.fused_coda_max_rows
    rule = ouro_exit if mode == "ouro" else delayed_exit
    for prompt, a, b in zip(PROMPTS, *runs):
        assert (a.token_ids, a.exit_depths) == (b.token_ids, b.exit_depths)
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
        want = oracle.generate(prompt, 8, exit_fn=rule(threshold), layout=layout)
        assert (a.token_ids, a.exit_depths) == want
