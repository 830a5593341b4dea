"""The CUDA-graph path's host side, on the CPU, against the dense fp32 oracle.

CUDA graphs exist only on a GPU, so CI never runs the code around them: which graph a launch picks, the
rows it binds, the static inputs it fills, the shared outputs and records it reads back. Here a capture is
emulated: it warms the round function up and runs it once as `CudaGraphs._capture` does, and remembers
it; a replay zeroes the graph's record and runs the function again on the static inputs as they are then;
the record's read-back copies it, as the pinned copy does on a GPU. Everything else is the engine's own
code. NOTE: what only a real capture does (host values frozen at capture time, graph memory pools, kernels
replayed without Python) is not covered: `tests/test_gpu.py` runs the same scenarios on a GPU.
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import ORACLE_PROMPTS as PROMPTS
from engine_helpers import alone, assert_same, drive, make_recording_engine, ouro_exit, run_all

from ouro_backend import SamplingParams
from ouro_backend.engine import cuda_graphs
from ouro_backend.engine.staging import Staging
from ouro_backend.model.sampler import SamplerMode

LAYOUTS = ["last_exited", "shared"]


class _EmulatedGraph:
    def __init__(self, fn, rec: torch.Tensor):
        self.fn, self.rec, self.replays = fn, rec, 0

    def replay(self) -> None:
        self.rec.zero_()  # a real graph zeroes its record inside itself
        self.fn(self.rec)
        self.replays += 1


@pytest.fixture
def emulated_graphs(monkeypatch):
    def capture(self, fn, rounds):
        for _ in range(2):  # the warm-up, as in the real capture
            fn(self.state.new_record(rounds))
        rec = self.state.new_record(rounds)
        result = fn(rec)
        return _EmulatedGraph(fn, rec), rec, result

    monkeypatch.setattr(cuda_graphs.CudaGraphs, "_capture", capture)
    # The record of a graph is overwritten by its next replay: the read-back must copy it.
    monkeypatch.setattr(Staging, "readback", lambda self, t: (t.clone(), None))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a, **k: 0)


def graph_engine(toy_path, **kw):
    """A CPU engine whose launches go through the (emulated) graphs, as `LLMEngine` captures them on CUDA."""
    eng = make_recording_engine(toy_path, **kw)
    eng.runner.record_logits = False  # the graphs' in-graph coda, as on the GPU
    cfg = eng.config
    eng.runner.capture_graphs(
        cfg.max_num_seqs, min(cfg.cuda_graph_max_tokens, cfg.max_num_batched_tokens), cfg.decode_rounds_per_launch
    )
    return eng


def graph_replays(eng, kinds=("decode", "mixed")) -> dict[str, int]:
    g = eng.runner.graphs
    return {kind: sum(x.graph.replays for x in getattr(g, kind).values()) for kind in kinds}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rounds", [1, 4])
def test_graph_launches_equal_oracle(toy_path, oracle, emulated_graphs, layout, rounds):
    eng = graph_engine(
        toy_path, kv_layout=layout, prefill_chunk_size=5, max_num_batched_tokens=16, decode_rounds_per_launch=rounds
    )
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, exit_threshold=0.5)
    for prompt, out in zip(PROMPTS, run_all(eng, PROMPTS, params)):
        assert (out.token_ids, out.exit_depths) == oracle.generate(prompt, 8, exit_fn=ouro_exit(0.5), layout=layout)
    stats = eng.stats()
    assert stats["eager_launches"] == 0 and stats["graph_launches"] > 0
    assert all(graph_replays(eng).values()), graph_replays(eng)
    if rounds > 1:
        assert stats["rounds"] > stats["launches"], "no launch ran several rounds"
    assert eng.kv.pool.num_available == eng.kv.num_blocks


@pytest.mark.parametrize("few_rows", [4, 8])
def test_mixed_graph_picks_bound_rows_only_below_every_slot(toy_path, emulated_graphs, monkeypatch, few_rows):
    """A round whose decode rows fit in FEW_ROWS replays the graph of FEW_ROWS bound rows, which runs them; with
    as many slots as FEW_ROWS there is only the every-slot graph, whose rows are the slots in order."""
    monkeypatch.setattr(cuda_graphs, "FEW_ROWS", few_rows)
    eng = graph_engine(toy_path, max_num_seqs=8, max_num_batched_tokens=32)
    graphs = eng.runner.graphs
    owners: list = [None] * 8
    owners[5] = owners[2] = object()
    with torch.inference_mode():  # as the runner calls it (the bound rows are an inference tensor)
        graph, rows = graphs.mixed_graph(20, 1, SamplerMode.GREEDY, [5, 2], owners)
        assert graph.tokens == 32
        if few_rows == 4:
            assert graph.rows == 4 and rows == [5, 2, 0, 1] == graphs._rows[:4].tolist()
        else:
            assert graph.rows == 8 and rows == list(range(8))
        many = graphs.mixed_graph(20, 1, SamplerMode.GREEDY, [0, 1, 2, 3, 5], [object()] * 8)
        assert many is not None and many[0].rows == 8 and many[1] == list(range(8))  # more than 4: every slot
        assert graphs.mixed_graph(33, 1, SamplerMode.GREEDY, [], owners) is None  # past the largest bucket


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("few_rows", [None, 4])
def test_graph_launches_staggered_requests_equal_oracle(
    toy_path, oracle, emulated_graphs, monkeypatch, layout, few_rows
):
    """Requests arrive every third step, then many at once, with per-request thresholds and loop bounds:
    prompt chunks meet from none to all 8 decode rows, and the row graphs run slots that are not a range.
    few_rows=4: mixed graphs beside 4 bound rows too (FEW_ROWS is 16, more rows than this engine has)."""
    if few_rows is not None:
        monkeypatch.setattr(cuda_graphs, "FEW_ROWS", few_rows)
    eng = graph_engine(
        toy_path,
        kv_layout=layout,
        max_num_seqs=8,
        prefill_chunk_size=5,
        max_num_batched_tokens=32,
        decode_rounds_per_launch=4,
    )
    graphs, bound = eng.runner.graphs, []
    bind = graphs.bind_rows

    def recording_bind(*args):
        bound.append(bind(*args))
        return bound[-1]

    graphs.bind_rows = recording_bind
    # A mixed graph of bound rows must run every decode row of its round (a row it missed would only stall a
    # round, with the same tokens): checked at each replay against the round's plan.
    runner, plans, few_replays = eng.runner, [], []
    mixed_round, replay_mixed = runner._mixed_round, runner._replay_mixed

    def recording_mixed_round(plan, launch):
        plans.append(list(plan.decode_slots))
        return mixed_round(plan, launch)

    def checked_replay(graph, batch, h):
        if graph.rows < runner.graphs.max_rows:
            ran = runner.graphs._rows[: graph.rows].tolist()
            assert set(plans[-1]) <= set(ran), (plans[-1], ran)
            few_replays.append(ran)
        return replay_mixed(graph, batch, h)

    runner._mixed_round, runner._replay_mixed = recording_mixed_round, checked_replay
    specs = [(0.5, 1, 4), (0.8, 2, 4), (0.3, 1, 3), (1.0, 1, 4), (0.6, 3, 4)]
    n = 11  # request i is request i % 5 again: its prompt, bounds and length
    requests = [
        (
            str(i),
            PROMPTS[i % 5 % 3],
            SamplingParams(
                max_tokens=6 + i % 5,
                temperature=0.0,
                ignore_eos=True,
                exit_threshold=specs[i % 5][0],
                min_loops=specs[i % 5][1],
                max_loops=specs[i % 5][2],
            ),
        )
        for i in range(n)
    ]
    arrivals = {str(i): 3 * i for i in range(4)} | {str(i): 12 for i in range(4, 9)} | {"9": 21, "10": 24}
    outs = drive(eng, requests, arrivals).final  # also: streams add up, no block leaked
    for k, (thr, lo, hi) in enumerate(specs):
        want = oracle.generate(PROMPTS[k % 3], 6 + k, exit_fn=ouro_exit(thr, lo, hi), layout=layout)
        for i in range(k, n, len(specs)):
            assert (outs[str(i)].token_ids, outs[str(i)].exit_depths) == want, i
    assert eng.stats()["eager_launches"] == 0
    assert all(graph_replays(eng).values()), graph_replays(eng)
    assert any(rows is not None and rows != list(range(len(rows))) for rows in bound), "no scattered slots ran"
    if few_rows is not None:  # and some of them ran scattered slots beside a chunk
        assert any(ran != list(range(few_rows)) for ran in few_replays), few_replays
    else:
        assert not few_replays and {d for d, _, _ in graphs.mixed} == {8}


def test_speculative_graphs_equal_oracle(toy_path, oracle, emulated_graphs):
    """Self-speculation (K = 4, one draft loop) through the speculative graphs: greedy tokens equal the
    oracle's full-depth decoding."""
    eng = graph_engine(toy_path, spec_tokens=4, spec_draft_loops=1, prefill_chunk_size=5, max_num_batched_tokens=16)
    outs = run_all(eng, PROMPTS, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == oracle.generate(prompt, 12)[0]
    assert eng.stats()["spec_steps"] > 0 and graph_replays(eng, ("spec",))["spec"] > 0


def test_sampled_speculative_graphs_equal_plain_sampling(toy_path, emulated_graphs):
    """Coupled sampling inside the speculative graphs: seeded sampled tokens equal a plain engine's."""
    params = [
        SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=5 + i, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]
    plain = run_all(make_recording_engine(toy_path), PROMPTS, params)
    eng = graph_engine(toy_path, spec_tokens=4, spec_draft_loops=2, spec_auto=False)
    assert [o.token_ids for o in run_all(eng, PROMPTS, params)] == [o.token_ids for o in plain]
    assert graph_replays(eng, ("spec",))["spec"] > 0


@pytest.mark.parametrize("layout, mode", [("last_exited", "recompute"), ("shared", "swap")])
def test_preemption_under_graph_launches_equals_runs_alone(toy_path, emulated_graphs, layout, mode):
    """A cache that holds half of what 8 requests grow to: blocks grow under graph launches of 4 rounds,
    requests are preempted and resumed, and each one's tokens and depths equal its run alone."""
    from test_kv_memory import NUM_BLOCKS, params
    from test_kv_memory import PROMPTS as KV_PROMPTS

    eng = graph_engine(
        toy_path,
        kv_layout=layout,
        num_blocks=NUM_BLOCKS[layout],
        exit_threshold=0.5,
        preemption_mode=mode,
        decode_rounds_per_launch=4,
    )
    outs = run_all(eng, KV_PROMPTS, [params(i, 0.5, False) for i in range(len(KV_PROMPTS))])
    st = eng.stats()
    assert st["num_preemptions"] > 0 and st["graph_launches"] > 0 and st["eager_launches"] == 0
    for i, (prompt, out) in enumerate(zip(KV_PROMPTS, outs)):
        assert_same(out, alone(toy_path, prompt, params(i, 0.5, False), kv_layout=layout), f"request {i}")
    assert eng.kv.pool.num_available == eng.kv.num_blocks
