"""KV accounting, admission under KV pressure, aborts at any point, and the batching itself."""

import pytest
from engine_helpers import ORACLE_PROMPTS as PROMPTS
from engine_helpers import make_recording_engine as make_engine
from engine_helpers import run_all

from ouro_backend import SamplingParams


def drain(eng, steps=None, outs=None):
    """Step until done (or for `steps` rounds); collect every output per request."""
    outs = {} if outs is None else outs
    for _ in range(steps or 10_000):
        if not eng.has_unfinished_requests():
            return outs
        for o in eng.step():
            outs.setdefault(o.request_id, []).append(o)
    assert steps, "engine did not finish"
    return outs


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
def test_kv_all_free_after_finish_and_abort(toy_path, layout):
    eng = make_engine(toy_path, kv_layout=layout, max_num_batched_tokens=8)
    total = eng.kv.num_blocks
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, exit_threshold=0.5)
    for i in range(6):
        eng.add_request(f"r{i}", PROMPTS[i % 3], params)
    outs = drain(eng, 1)  # r0 prefilling, others waiting/admitted
    assert eng.scheduler.find("r5") in eng.scheduler.waiting
    eng.abort_request("r5")
    drain(eng, 2, outs)
    assert eng.scheduler.find("r0").slot in eng.scheduler.chunks
    eng.abort_request("r0")  # a prompt chunk mid-loops
    drain(eng, 9, outs)
    assert not eng.scheduler.find("r1").in_prefill
    eng.abort_request("r1")  # decoding
    drain(eng, outs=outs)
    assert {k: v[-1].finish_reason for k, v in outs.items()} == {
        "r0": "abort",
        "r1": "abort",
        "r2": "length",
        "r3": "length",
        "r4": "length",
        "r5": "abort",
    }
    assert eng.kv.pool.num_available == total
    assert eng.stats()["kv_usage"] == 0.0 and eng.stats()["num_aborted"] == 3


def test_admission_waits_for_kv_and_resumes(toy_path):
    # Each request reserves 4 planes x ceil((13 + 7) / 4) = 20 blocks; 30 blocks admit one at a time.
    eng = make_engine(toy_path, num_blocks=30)
    params = SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)
    for i in range(3):
        eng.add_request(str(i), PROMPTS[0], params)
    eng.step()
    assert eng.stats()["num_running"] == 1 and eng.stats()["num_waiting"] == 2
    outs = drain(eng)
    assert all(outs[str(i)][-1].finish_reason == "length" for i in range(3))
    assert outs["0"][-1].token_ids == outs["1"][-1].token_ids == outs["2"][-1].token_ids
    assert eng.kv.pool.num_available == 30


def test_request_larger_than_cache_is_rejected(toy_path):
    from ouro_backend import RequestError

    eng = make_engine(toy_path, num_blocks=10)
    with pytest.raises(RequestError, match="KV blocks"):
        eng.add_request("big", PROMPTS[0], SamplingParams(max_tokens=40))
    assert not eng.has_unfinished_requests()


def test_exited_rows_are_refilled(toy_path):
    """Early exit turns into throughput: with exits, the same tokens take fewer rows-at-loop."""

    def rows(threshold):
        eng = make_engine(toy_path)
        run_all(eng, PROMPTS, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, exit_threshold=threshold))
        return eng.stats()["steps"]

    assert rows(0.3) < rows(1.0)


def test_depths_mix_inside_one_round(toy_path):
    """Tokens of different depths exit in the same round: its rows were at different loops."""
    eng = make_engine(toy_path, decode_rounds_per_launch=1)
    seen_mixed = False
    collect = eng.runner.collect

    def spy(launch):
        nonlocal seen_mixed
        emitted = collect(launch)
        seen_mixed |= len({e.depth for e in emitted}) > 1
        return emitted

    eng.runner.collect = spy
    run_all(eng, PROMPTS, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, exit_threshold=0.5))
    assert seen_mixed


def test_prefill_interleaves_with_decode_under_token_budget(toy_path):
    eng = make_engine(toy_path, max_num_batched_tokens=8, prefill_chunk_size=8)
    launch = eng.runner.launch
    sizes = []

    def spy(plan):
        sizes.append(
            (sum(c.n for c in plan.prefill) + len(plan.decode_slots), bool(plan.prefill), bool(plan.decode_slots))
        )
        return launch(plan)

    eng.runner.launch = spy
    eng.add_request("a", PROMPTS[1], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    for _ in range(6):
        eng.step()
    eng.add_request("b", PROMPTS[2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    drain(eng)
    assert max(n for n, _, _ in sizes) <= 8
    assert any(p and d for _, p, d in sizes), "a prompt chunk should share rounds with decode rows"
