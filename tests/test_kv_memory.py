"""KV memory on demand (docs/kv-memory.md): blocks are taken as requests advance, and when they run out the
newest requests are preempted (recomputed at their recorded exit depths, or swapped to host memory) and
resumed, with every request's output exactly what it gets alone on a large cache (fp32, CPU), and
nothing leaked."""

from __future__ import annotations

import pytest
from engine_helpers import alone, assert_same, drive
from engine_helpers import make_plain_engine as make_engine

from ouro_backend import SamplingParams
from ouro_backend.config import ConfigError, EngineConfig

PROMPTS = [[10 + i, 200 + 7 * i, 3 * i + 1, 900 - i] for i in range(8)]  # 4 tokens each
MAX_TOKENS = 28  # 4 + 28 = 32 positions: 8 blocks of 4 per plane
# One request's whole prompt + max_tokens is a quarter of the cache: 4 planes x 8 blocks of 128 under
# LAST_EXITED; 3 prompt blocks + 8 under SHARED, of 48.
NUM_BLOCKS = {"last_exited": 128, "shared": 48}


def params(i: int, threshold: float, sampled: bool) -> SamplingParams:
    return SamplingParams(
        max_tokens=MAX_TOKENS,
        ignore_eos=True,
        exit_threshold=threshold,
        temperature=0.8 if sampled else 0.0,
        seed=1000 + i if sampled else None,
    )


def check_clean(eng) -> None:
    st = eng.stats()
    assert st["kv_blocks_free"] == st["kv_blocks_total"] and st["num_swapped"] == 0 and st["swap_bytes"] == 0
    assert not eng.runner.swap.saved, "a saved row outlived its request"


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
def test_requests_whose_whole_length_fills_a_quarter_all_start_at_once(toy_path, layout):
    """Admission takes only the prompt and a few launches of decode room: 8 such requests start together
    (reserving prompt + max_tokens, 4 would)."""
    eng = make_engine(toy_path, kv_layout=layout, num_blocks=NUM_BLOCKS[layout])
    need = eng.kv.blocks_needed(4, 4 + MAX_TOKENS)
    assert 4 * need <= eng.kv.num_blocks < 5 * need
    for i, p in enumerate(PROMPTS):
        eng.add_request(str(i), p, params(i, 1.0, False))
    eng.step()
    assert eng.stats()["num_running"] == 8
    while eng.has_unfinished_requests():
        eng.step()
    check_clean(eng)


EXACT_MODES = [("last_exited", "recompute"), ("last_exited", "swap"), ("shared", "swap")]


@pytest.mark.parametrize("layout, mode", EXACT_MODES, ids=[f"{a}-{b}" for a, b in EXACT_MODES])
@pytest.mark.parametrize("threshold", [pytest.param(1.0, id="full"), pytest.param(0.5, id="gate")])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_overflowing_cache_preempts_and_every_request_equals_its_run_alone(
    toy_path, layout, mode, threshold, async_scheduling, sampled
):
    """All 8 generate to max_tokens, twice what the cache holds: requests are preempted and resumed, yet
    each one's tokens, exit depths and logprobs are its own alone on a large cache; all blocks free after."""
    eng = make_engine(
        toy_path,
        kv_layout=layout,
        num_blocks=NUM_BLOCKS[layout],
        async_scheduling=async_scheduling,
        preemption_mode=mode,
    )
    run = drive(eng, [(str(i), p, params(i, threshold, sampled)) for i, p in enumerate(PROMPTS)])
    st = eng.stats()
    assert st["num_preemptions"] > 0
    assert (st["num_recomputes"] == st["num_preemptions"]) == (mode == "recompute")
    for i, p in enumerate(PROMPTS):
        ref = alone(toy_path, p, params(i, threshold, sampled), kv_layout=layout)
        assert_same(run.final[str(i)], ref, f"request {i}")
        assert len(ref.token_ids) == MAX_TOKENS
    if threshold < 1.0:
        assert min(d for o in run.final.values() for d in o.exit_depths) < 4  # the gate did exit early
    check_clean(eng)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_under_speculation_is_exact(toy_path, mode):
    """Speculative steps write drafts past a row's last token: the blocks ahead cover them, and a preempted
    speculating request resumes exactly."""
    eng = make_engine(
        toy_path, num_blocks=128, spec_tokens=3, spec_auto=False, exit_threshold=1.0, preemption_mode=mode
    )
    run = drive(eng, [(str(i), p, params(i, 1.0, False)) for i, p in enumerate(PROMPTS)])
    st = eng.stats()
    assert st["num_preemptions"] > 0 and st["spec_steps"] > 0
    for i, p in enumerate(PROMPTS):
        assert_same(run.final[str(i)], alone(toy_path, p, params(i, 1.0, False), exit_threshold=1.0), f"request {i}")
    check_clean(eng)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_aborts_of_preempted_and_running_requests_leak_nothing(toy_path, mode):
    """Abort a preempted request (swapped, or waiting to be recomputed) and a running one: both end with what
    they had, the others are exact, and nothing is left behind."""
    aborted: list[str] = []

    def hook(eng, step, run):
        preempted = [s for s in (*eng.scheduler.swapped, *eng.scheduler.waiting) if s.output_ids]
        if not aborted and preempted:
            running = eng.scheduler.running[0].request_id
            aborted.extend([preempted[0].request_id, running])
            for rid in aborted:
                eng.abort_request(rid)

    eng = make_engine(toy_path, num_blocks=128, async_scheduling=True, preemption_mode=mode)
    run = drive(eng, [(str(i), p, params(i, 0.5, False)) for i, p in enumerate(PROMPTS)], hook=hook)
    assert len(aborted) == 2
    for i, p in enumerate(PROMPTS):
        out, ref = run.final[str(i)], alone(toy_path, p, params(i, 0.5, False))
        if str(i) in aborted:
            assert out.finish_reason == "abort" and out.token_ids == ref.token_ids[: len(out.token_ids)]
        else:
            assert_same(out, ref, f"request {i}")
    check_clean(eng)


def test_full_swap_space_falls_back_to_recompute(toy_path):
    """Swap space for nothing: every preemption recomputes, and under last_exited that is still exact."""
    eng = make_engine(toy_path, num_blocks=128, preemption_mode="swap", swap_space_gib=1e-9)
    run = drive(eng, [(str(i), p, params(i, 0.5, False)) for i, p in enumerate(PROMPTS)])
    st = eng.stats()
    assert st["num_preemptions"] > 0 and st["num_recomputes"] == st["num_preemptions"]
    for i, p in enumerate(PROMPTS):
        assert_same(run.final[str(i)], alone(toy_path, p, params(i, 0.5, False)), f"request {i}")
    check_clean(eng)


def test_recompute_under_the_shared_layout_completes_and_says_it_is_inexact(toy_path, caplog):
    """Under shared, a recomputed token attends to its predecessors' loop-d KV where decoding attended to
    their exit-loop KV: it is served (with a warning), but not claimed exact."""
    eng = make_engine(toy_path, kv_layout="shared", num_blocks=NUM_BLOCKS["shared"], preemption_mode="recompute")
    run = drive(eng, [(str(i), p, params(i, 1.0, False)) for i, p in enumerate(PROMPTS)])
    assert eng.stats()["num_recomputes"] > 0
    assert all(len(o.token_ids) == MAX_TOKENS for o in run.final.values())
    assert "is not exact" in caplog.text
    check_clean(eng)


def test_a_request_that_cannot_fit_alone_is_rejected_at_admission(toy_path):
    from ouro_backend.engine.llm_engine import RequestError

    eng = make_engine(toy_path, num_blocks=16)
    with pytest.raises(RequestError, match="needs 32 KV blocks but the cache only has 16"):
        eng.add_request("big", PROMPTS[0], params(0, 1.0, False))


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(kv_watermark=1.0), "kv_watermark must be in"),
        (dict(swap_space_gib=-1.0), "swap_space_gib must be >= 0"),
        (dict(preemption_mode="drop"), "preemption_mode='drop' is not supported"),
    ],
)
def test_kv_options_are_validated(bad, match):
    with pytest.raises(ConfigError, match=match):
        EngineConfig(**bad).validate()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_cache_for_one_request_at_a_time(toy_path, mode, async_scheduling):
    """Three requests in a cache that holds about one: they preempt each other again and again, after 3 to 16
    tokens (a resumed request starts at a token it already has, not sampling it again), and each is exact."""
    eng = make_engine(
        toy_path, num_blocks=36, preemption_mode=mode, async_scheduling=async_scheduling, decode_rounds_per_launch=1
    )
    # 6-token prompts: a request's first token already takes its decode planes into a new block.
    reqs = [(str(i), p + [7, 8], params(i, 0.5, False)) for i, p in enumerate(PROMPTS[:3])]
    run = drive(eng, reqs)
    assert eng.stats()["num_preemptions"] >= 3
    for rid, p, sp in reqs:
        assert_same(run.final[rid], alone(toy_path, p, sp), f"request {rid}")
    check_clean(eng)


# ------------------------------------------------------------------------------------------ prefix caching
PREFIX = [(37 * i + 11) % 1000 + 3 for i in range(64)]  # 64 tokens: 16 blocks of 4


def cached_engine(toy_path, **kw):
    return make_engine(toy_path, enable_prefix_caching=True, **kw)


@pytest.mark.parametrize("threshold", [pytest.param(1.0, id="full"), pytest.param(0.5, id="gate")])
def test_a_shared_64_token_prefix_is_cached_and_changes_nothing(toy_path, threshold):
    """A second request with the same 64-token prefix reads its blocks from the cache (num_cached_tokens = 64)
    and produces exactly what it produces with no cache; unrelated prompts find nothing."""
    eng = cached_engine(toy_path)
    first = (PREFIX + [5, 6, 7], params(0, threshold, False))
    second = (PREFIX + [900, 901], params(1, threshold, False))
    other = ([8, 9, 10] + PREFIX, params(2, threshold, False))
    run = drive(eng, [("a", *first), ("b", *second), ("c", *other)], arrivals={"b": 30, "c": 30})
    assert run.final["a"].num_cached_tokens == 0 and run.final["b"].num_cached_tokens == 64
    assert run.final["c"].num_cached_tokens == 0
    for rid, (prompt, p) in (("a", first), ("b", second), ("c", other)):
        assert_same(run.final[rid], alone(toy_path, prompt, p), rid)
    st = eng.stats()
    assert st["prefix_cache_hit_rate"] == pytest.approx(64 / (67 + 66 + 67))
    assert st["kv_blocks_free"] == st["kv_blocks_total"] and st["prefix_cache_blocks"] > 0


def test_reset_prefix_cache_forgets_idle_prompts(toy_path):
    """After reset_prefix_cache the same prompt is prefilled again and every block is free; entries that a
    running request holds are not taken from it."""
    eng = cached_engine(toy_path)
    prompt, p = PREFIX + [5, 6, 7], params(0, 1.0, False)
    assert drive(eng, [("a", prompt, p)]).final["a"].num_cached_tokens == 0
    eng.reset_prefix_cache()
    st = eng.stats()
    assert st["prefix_cache_blocks"] == 0 and st["kv_blocks_free"] == st["kv_blocks_total"]
    assert drive(eng, [("b", prompt, p)]).final["b"].num_cached_tokens == 0

    def reset_midway(eng, step, run):
        if step == 2:
            eng.reset_prefix_cache()

    assert drive(eng, [("c", prompt, p)], hook=reset_midway).final["c"].num_cached_tokens == 64
    assert drive(eng, [("d", prompt, p)]).final["d"].num_cached_tokens == 64  # c held b's entries at the reset
    check_clean(eng)


def test_prefix_cache_under_pressure_evicts_and_stays_exact(toy_path):
    """A small cache, prompts sharing prefixes of different lengths, preemptions: idle entries are evicted
    for new blocks, outputs equal runs alone, and every block is free or idle in the cache at the end."""
    eng = cached_engine(toy_path, num_blocks=160, async_scheduling=True)
    reqs = [(str(i), PREFIX[: 16 * (1 + i % 4)] + [3 + i, 50 + i], params(i, 0.5, False)) for i in range(8)]
    run = drive(eng, reqs, arrivals={str(i): 6 * i for i in range(8)})
    st = eng.stats()
    assert st["num_preemptions"] > 0 and any(o.num_cached_tokens > 0 for o in run.final.values())
    for rid, prompt, p in reqs:
        assert_same(run.final[rid], alone(toy_path, prompt, p), f"request {rid}")
    pool = eng.kv.pool
    assert pool.num_idle_blocks == pool.num_cached_blocks  # no request holds an entry any more
    assert st["prefix_cache_blocks"] == pool.num_idle_blocks > 0
    check_clean(eng)


def test_prefix_caching_under_shared_is_refused():
    with pytest.raises(ConfigError, match="enable_prefix_caching needs kv_layout=last_exited"):
        EngineConfig(enable_prefix_caching=True, kv_layout="shared").validate()


def test_prefix_caching_defaults_to_the_layouts_support(toy_path):
    """Unset, it is on under LAST_EXITED and off under SHARED; false turns it off; a non-bool is refused."""
    assert make_engine(toy_path).kv.pool.enable_prefix_caching
    assert not make_engine(toy_path, kv_layout="shared").kv.pool.enable_prefix_caching
    assert not make_engine(toy_path, enable_prefix_caching=False).kv.pool.enable_prefix_caching
    assert EngineConfig.from_strings({"enable_prefix_caching": "false"}).prefix_caching is False
    assert EngineConfig.from_strings({"enable_prefix_caching": ""}).prefix_caching is True
    with pytest.raises(ConfigError, match="enable_prefix_caching"):
        EngineConfig(enable_prefix_caching="yes").validate()
