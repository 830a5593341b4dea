"""Exit rules: hand-computed hazards, loop bounds, delayed decisions, trace replay, random lookahead."""

import pytest
import torch
from engine_helpers import ORACLE_PROMPTS as PROMPTS
from engine_helpers import make_recording_engine as make_engine
from engine_helpers import ouro_exit, run_all

from ouro_backend import SamplingParams
from ouro_backend.config import ExitMode
from ouro_backend.engine.exit_policy import ExitInputs, exit_rule

GATES = [0.2, 0.5, 0.6, 0.9]  # remaining: 0.8, 0.4, 0.16, 0.016 -> cdf: 0.2, 0.6, 0.84, 0.984


def exit_loop(mode, gates=GATES, min_loops=1, max_loops=4, threshold=0.55, trace_depth=None):
    """Drive the vectorised rule for one row (the same row twice, to check rows stay independent)."""
    two = lambda v, dt: torch.tensor([v, v], dtype=dt)  # noqa: E731
    remaining, pending = two(1.0, torch.float32), two(False, torch.bool)
    for r, lam in enumerate(gates, start=1):
        x = ExitInputs(
            two(r, torch.int64),
            remaining,
            pending,
            two(min_loops, torch.int64),
            two(max_loops, torch.int64),
            two(threshold, torch.float64),
            None if trace_depth is None else two(trace_depth, torch.int64),
        )
        exit_now, remaining, pending = exit_rule(ExitMode(mode), x, two(lam, torch.float32))
        assert exit_now[0] == exit_now[1]
        if exit_now[0]:
            return r
    return None


@pytest.mark.parametrize(
    "kw, ouro, delayed",
    [
        (dict(threshold=0.55), 2, 3),  # cdf_2 = 0.6 crosses 0.55; delayed applies it after loop 3
        (dict(threshold=0.19), 1, 2),  # cdf_1 = 0.2
        (dict(threshold=0.9), 4, 4),  # cdf_4 = 0.984 crosses; delayed is capped by max_loops
        (dict(threshold=0.55, min_loops=3), 3, 4),
        (dict(threshold=0.9, max_loops=2), 2, 2),
        (dict(threshold=1.0), 4, 4),  # 1.0 means fixed depth max_loops
        (dict(threshold=1.0, max_loops=3), 3, 3),
        (dict(threshold=0.0, min_loops=2), 2, 3),
    ],
)
def test_hand_computed_hazard(kw, ouro, delayed):
    assert exit_loop("ouro", **kw) == ouro
    assert exit_loop("ouro_delayed", **kw) == delayed


def test_fixed_and_trace_modes():
    assert exit_loop("fixed", threshold=0.1, max_loops=3) == 3
    for depth in (1, 2, 4):
        assert exit_loop("trace", trace_depth=depth) == depth


def test_random_lookahead_exits_one_loop_after_firing():
    # lam >= threshold at loop 2 -> exit after loop 3
    assert exit_loop("random_lookahead", gates=[0.1, 0.7, 0.1, 0.1], threshold=0.6) == 3
    assert exit_loop("random_lookahead", gates=[0.7, 0.1, 0.1, 0.1], threshold=0.6, min_loops=3) == 3
    assert exit_loop("random_lookahead", gates=[0.1] * 4, threshold=0.6) == 4


def test_trace_replay_reproduces_depths(toy_path):
    eng = make_engine(toy_path, exit_mode="trace")
    traces = [[1, 3, 2, 4], [2], [4, 1]]
    params = [SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True, exit_trace=t) for t in traces]
    outs = run_all(eng, PROMPTS, params)
    for out, trace in zip(outs, traces):
        assert out.exit_depths[0] == 4  # produced by the prompt, which always runs all loops
        assert out.exit_depths[1:] == [trace[k % len(trace)] for k in range(8)]


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
def test_ouro_delayed_matches_oracle(toy_path, oracle, layout):
    def delayed(gates):
        return min(ouro_exit(0.6)(gates) + 1, 4)

    eng = make_engine(toy_path, exit_mode="ouro_delayed", kv_layout=layout)
    outs = run_all(eng, PROMPTS[:2], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, exit_threshold=0.6))
    for prompt, out in zip(PROMPTS, outs):
        tokens, depths = oracle.generate(prompt, 6, exit_fn=delayed, layout=layout)
        assert (out.token_ids, out.exit_depths) == (tokens, depths)


def test_loop_bounds_in_engine(toy_path):
    eng = make_engine(toy_path)
    outs = run_all(
        eng,
        PROMPTS,
        [
            SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, exit_threshold=0.0, min_loops=3),
            SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, exit_threshold=1.0, max_loops=2),
            SamplingParams(
                max_tokens=8, temperature=0.0, ignore_eos=True, exit_threshold=0.3, min_loops=2, max_loops=3
            ),
        ],
    )
    assert outs[0].exit_depths[1:] == [3] * 7  # threshold 0 exits as soon as min_loops allows
    assert outs[1].exit_depths[1:] == [2] * 7
    assert all(2 <= d <= 3 for d in outs[2].exit_depths[1:])


def test_random_lookahead_engine_is_seeded(toy_path):
    runs = []
    for _ in range(2):
        eng = make_engine(toy_path, exit_mode="random_lookahead", seed=7)
        runs.append(
            run_all(eng, PROMPTS, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, exit_threshold=0.5))
        )
    depths = [o.exit_depths for o in runs[0]]
    assert depths == [o.exit_depths for o in runs[1]]
    assert all(1 <= d <= 4 for ds in depths for d in ds)
