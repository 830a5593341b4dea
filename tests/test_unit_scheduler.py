"""Model-free unit tier: the `Scheduler` on a tiny CPU `KVCache`, driven by hand (no runner, no model).

The engine's loop is `plan = schedule(); <launch>; launched(plan); <append read-back tokens>`. Here the
launch is skipped and tokens are appended by the test where the device would have produced them, so each
plan's prompt chunks, decode slots, admissions, releases, table growth and preemptions can be asserted
exactly (tests/conftest.py, tier `unit`). Geometry everywhere: block_size 4, 4 loops (planes),
last_exited unless a test says otherwise; `decode_rounds_per_launch=1` so the lookahead is 2 positions.
"""

from __future__ import annotations

from collections import deque

import torch

from ouro_backend.config import EngineConfig, KVLayout
from ouro_backend.engine.kv_cache import KVCache
from ouro_backend.engine.scheduler import PrefillChunk, Scheduler, SchedulerOutput
from ouro_backend.engine.sequence import Sequence, Status, StopChecker
from ouro_backend.model.sampler import SamplerMode
from ouro_backend.outputs import FinishReason
from ouro_backend.sampling_params import SamplingParams

BS, T = 4, 4


def make(num_blocks=32, layout="last_exited", prefix=False, **kw) -> Scheduler:
    kw.setdefault("decode_rounds_per_launch", 1)
    kw.setdefault("kv_watermark", 0.0)
    cfg = EngineConfig(block_size=BS, kv_layout=layout, enable_prefix_caching=prefix, **kw).validate()
    assert cfg.model is None  # nothing here resolves or loads a model
    kv = KVCache(
        2,
        num_blocks,
        BS,
        1,
        2,
        T,
        KVLayout(layout),
        torch.float32,
        torch.device("cpu"),
        enable_prefix_caching=cfg.prefix_caching,
    )
    return Scheduler(cfg, kv, T)


def req(rid, n, max_tokens=8, start=100, temperature=0.0) -> Sequence:
    return Sequence(
        rid,
        list(range(start, start + n)),
        SamplingParams(max_tokens=max_tokens, temperature=temperature),
        0,
        StopChecker([]),
    )


def chunks(plan: SchedulerOutput):
    return [(c.seq.request_id, c.slot, c.start, c.n, c.loop) for c in plan.prefill]


def ids(seqs):
    return [s.request_id for s in seqs]


def step(s: Scheduler) -> SchedulerOutput:
    plan = s.schedule()
    s.launched(plan)
    return plan


def emit(*seqs, token=1, depth=4):
    for seq in seqs:
        seq.append_token(token, depth, 0.0)


def run_prefill(s: Scheduler, n_steps: int = T) -> list[SchedulerOutput]:
    return [step(s) for _ in range(n_steps)]


# --------------------------------------------------------------------------------------------- basics


def test_config_derived_limits():
    s = make(num_blocks=40, max_num_seqs=3, max_num_batched_tokens=16, kv_watermark=0.1)
    assert (s.max_num_seqs, s.max_tokens, s.chunk, s.decode_rounds) == (3, 16, 16, 1)
    assert s.lookahead == 2 and s.watermark == 4 and s.free_slots == [0, 1, 2] and s.owners == [None] * 3
    assert s.swap_first is False  # auto under last_exited: recompute
    assert make(layout="shared").swap_first is True  # auto under shared: swap
    assert make(preemption_mode="swap").swap_first is True
    assert make(decode_rounds_per_launch=4).lookahead == 8
    assert make(prefill_chunk_size=4, max_num_batched_tokens=16, max_num_seqs=4).chunk == 4
    spec = make(spec_tokens=3, exit_threshold=1.0)
    assert spec.lookahead == 2 * 4 + 3 and spec.spec_policy is not None
    assert spec.max_positions(10, 5) == 18 and make().max_positions(10, 5) == 15


def test_empty_schedule_has_no_work():
    s = make()
    plan = s.schedule()
    assert not plan.has_work and plan.prefill == [] and plan.decode_slots == [] and plan.num_rounds == 1
    assert plan.owners == [None] * 64 and plan.sampler is SamplerMode.GREEDY
    assert not s.has_unfinished() and s.num_unfinished == 0


def test_add_find_and_finish_a_waiting_request():
    s = make()
    a, b = req("a", 3), req("b", 3)
    s.add(a)
    s.add(b)
    assert s.has_unfinished() and s.num_unfinished == 2 and ids(s.waiting) == ["a", "b"]
    assert s.find("b") is b and s.find("zz") is None
    s.finish(a, FinishReason.ABORT)
    assert a.finished and a.finish_reason == "abort" and ids(s.waiting) == ["b"]
    assert s.find("a") is None


# ----------------------------------------------------------------------------------------- admission


def test_admission_order_slots_and_blocks():
    s = make(num_blocks=32, max_num_seqs=3, max_num_batched_tokens=32)
    a, b, c, d = req("a", 6, 4), req("b", 3, 4, start=200), req("c", 9, 2, start=300), req("d", 1, start=400)
    for x in (a, b, c, d):
        s.add(x)
    plan = s.schedule()
    assert ids(plan.admitted) == ["a", "b", "c"] and ids(s.waiting) == ["d"]  # d: no slot left
    assert [x.slot for x in (a, b, c)] == [0, 1, 2] and s.free_slots == []
    assert all(x.status is Status.RUNNING for x in (a, b, c)) and d.status is Status.WAITING
    # Horizon = min(prompt + max_tokens, tokens + lookahead 2): a 8, b 5, c 11 -> 2, 2, 3 blocks per plane.
    assert a.block_tables == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert b.block_tables == [[8, 9], [10, 11], [12, 13], [14, 15]]
    assert c.block_tables == [[16, 17, 18], [19, 20, 21], [22, 23, 24], [25, 26, 27]]
    assert s.kv.pool.num_free == 4
    assert chunks(plan) == [("a", 0, 0, 6, 1), ("b", 1, 0, 3, 1), ("c", 2, 0, 9, 1)]
    assert plan.decode_slots == [] and plan.released == [] and plan.table_growth == []
    assert plan.owners == [a, b, c] and plan.has_work
    assert [x.prefill_target for x in (a, b, c)] == [6, 3, 9]


def test_fcfs_head_blocks_later_requests_that_would_fit():
    s = make(num_blocks=16, max_num_seqs=4, max_num_batched_tokens=32)
    a, b, c = req("a", 10, 4), req("b", 8, 4), req("c", 2, 4)
    for x in (a, b, c):
        s.add(x)
    plan = s.schedule()
    assert ids(plan.admitted) == ["a"]  # 3 blocks x 4 planes = 12
    assert s.kv.pool.num_free == 4
    # b needs 12 > 4; c needs 4 and would fit, but waits behind b (the head cannot starve).
    assert ids(s.waiting) == ["b", "c"]
    for _ in range(3):
        assert step(s).admitted == []


def test_watermark_applies_only_while_others_run():
    s = make(num_blocks=20, max_num_seqs=4, max_num_batched_tokens=32, kv_watermark=0.2)
    assert s.watermark == 4
    a, b, c = req("a", 6, 2), req("b", 6, 2), req("c", 1, 2)
    for x in (a, b, c):
        s.add(x)
    plan = s.schedule()
    # a: 8 blocks of 20. b: 8 <= 12 - 4. c: 4 > 4 - 4.
    assert ids(plan.admitted) == ["a", "b"] and ids(s.waiting) == ["c"] and s.kv.pool.num_free == 4

    alone = make(num_blocks=20, max_num_seqs=4, max_num_batched_tokens=32, kv_watermark=0.2)
    big = req("big", 18, 2)  # 20 positions: 5 blocks x 4 planes, the whole pool
    alone.add(big)
    assert ids(alone.schedule().admitted) == ["big"] and alone.kv.pool.num_free == 0


def test_budget_limits_admission():
    s = make(max_num_seqs=4, max_num_batched_tokens=8)
    a, b = req("a", 10), req("b", 2)
    s.add(a)
    s.add(b)
    plan = step(s)
    assert chunks(plan) == [("a", 0, 0, 8, 1)] and ids(plan.admitted) == ["a"]  # the budget is spent
    assert ids(s.waiting) == ["b"]
    plan = step(s)
    assert chunks(plan) == [("a", 0, 0, 8, 2)] and plan.admitted == []  # a chunk mid-loops always continues


# ---------------------------------------------------------------------------------------- chunked prefill


def test_chunked_prefill_progress_loop_by_loop():
    s = make(max_num_seqs=2, max_num_batched_tokens=8, prefill_chunk_size=4)
    a, b = req("a", 10, 4), req("b", 3, 4, start=200)
    s.add(a)
    s.add(b)
    plans = []
    for i in range(13):
        plans.append(step(s))
        if i == 3:
            emit(b)  # b's prompt finished in launch 3: its first token comes back
    got = [(chunks(p), p.decode_slots) for p in plans]
    assert got == [
        # a: chunk [0, 4) at loops 1..4; b (3 tokens) fits the rest of the budget of 8.
        ([("a", 0, 0, 4, 1), ("b", 1, 0, 3, 1)], []),
        ([("a", 0, 0, 4, 2), ("b", 1, 0, 3, 2)], []),
        ([("a", 0, 0, 4, 3), ("b", 1, 0, 3, 3)], []),
        ([("a", 0, 0, 4, 4), ("b", 1, 0, 3, 4)], []),
        # b decodes (one token of the budget); a's next chunk [4, 8) runs its four loops.
        ([("a", 0, 4, 4, 1)], [1]),
        ([("a", 0, 4, 4, 2)], [1]),
        ([("a", 0, 4, 4, 3)], [1]),
        ([("a", 0, 4, 4, 4)], [1]),
        ([("a", 0, 8, 2, 1)], [1]),
        ([("a", 0, 8, 2, 2)], [1]),
        ([("a", 0, 8, 2, 3)], [1]),
        ([("a", 0, 8, 2, 4)], [1]),
        ([], [0, 1]),  # a's prompt is done: both decode
    ]
    assert (a.num_prefilled, a.prefill_target, a.in_prefill) == (10, 10, False)
    assert (b.num_prefilled, b.in_prefill) == (3, False)
    assert [p.admitted for p in plans[1:]] == [[]] * 12 and ids(plans[0].admitted) == ["a", "b"]


def test_leftover_budget_trims_a_chunk_and_decode_rows_take_one_token_each():
    s = make(num_blocks=64, max_num_seqs=3, max_num_batched_tokens=6, prefill_chunk_size=4)
    a, b = req("a", 10), req("b", 5, start=200)
    s.add(a)
    s.add(b)
    plan = step(s)
    assert chunks(plan) == [("a", 0, 0, 4, 1), ("b", 1, 0, 2, 1)]  # b gets what is left of 6
    run_prefill(s, 3)
    plan = step(s)
    assert chunks(plan) == [("a", 0, 4, 4, 1), ("b", 1, 2, 2, 1)]  # both at the chunk size; 2 then 2 left
    run_prefill(s, 3)
    c = req("c", 9, start=300)
    s.add(c)
    plan = step(s)
    assert chunks(plan) == [("a", 0, 8, 2, 1), ("b", 1, 4, 1, 1), ("c", 2, 0, 3, 1)]
    run_prefill(s, 3)
    emit(a, b)
    plan = step(s)
    # Two decode rows take 2 of the 6 tokens; c's next chunk gets the other 4.
    assert plan.decode_slots == [0, 1] and chunks(plan) == [("c", 2, 3, 4, 1)]


def test_num_prefilled_advances_only_after_the_last_loop():
    s = make(max_num_seqs=1, max_num_batched_tokens=4)
    a = req("a", 6)
    s.add(a)
    seen = []
    for _ in range(8):
        plan = step(s)
        seen.append((chunks(plan), a.num_prefilled, dict((k, (c.start, c.n, c.loop)) for k, c in s.chunks.items())))
    assert seen == [
        ([("a", 0, 0, 4, 1)], 0, {0: (0, 4, 2)}),
        ([("a", 0, 0, 4, 2)], 0, {0: (0, 4, 3)}),
        ([("a", 0, 0, 4, 3)], 0, {0: (0, 4, 4)}),
        ([("a", 0, 0, 4, 4)], 4, {}),
        ([("a", 0, 4, 2, 1)], 4, {0: (4, 2, 2)}),
        ([("a", 0, 4, 2, 2)], 4, {0: (4, 2, 3)}),
        ([("a", 0, 4, 2, 3)], 4, {0: (4, 2, 4)}),
        ([("a", 0, 4, 2, 4)], 6, {}),
    ]
    emit(a)
    plan = step(s)
    assert plan.prefill == [] and plan.decode_slots == [0] and s.chunks == {}


def test_decode_rows_span_every_running_request_past_its_prompt():
    s = make(num_blocks=64, max_num_seqs=3, max_num_batched_tokens=16, decode_rounds_per_launch=4)
    assert s.lookahead == 8
    a, b = req("a", 4), req("b", 4, start=200)
    s.add(a)
    s.add(b)
    run_prefill(s)
    plan = step(s)
    # Both prompts are done, but no first token is back yet: one round, not four.
    assert plan.decode_slots == [0, 1] and plan.prefill == [] and plan.num_rounds == 1
    emit(a)
    assert step(s).num_rounds == 1  # b's first token is still out
    emit(b)
    plan = step(s)
    assert plan.decode_slots == [0, 1] and plan.num_rounds == 4
    c = req("c", 2, start=300)
    s.add(c)
    plan = step(s)  # prompt work: one round again
    assert plan.num_rounds == 1 and chunks(plan) == [("c", 2, 0, 2, 1)] and plan.decode_slots == [0, 1]


def test_a_request_that_ends_with_its_prompt_takes_no_decode_row():
    """max_tokens 1: the prompt's last loop makes the only token, so the plans made while it comes back (the
    next launch is planned before the read-back) give the request no decode row; alone, they have no work.
    A request allowed two tokens beside it decodes as usual."""
    s = make(num_blocks=64, max_num_seqs=3, max_num_batched_tokens=16)
    a, b = req("a", 4, max_tokens=1), req("b", 4, max_tokens=2, start=200)
    s.add(a)
    run_prefill(s)
    plan = step(s)
    assert plan.decode_slots == [] and not plan.has_work and a.status is Status.RUNNING
    s.add(b)
    run_prefill(s)
    assert step(s).decode_slots == [1]  # b's row; a's token is still on its way
    emit(a)
    s.finish(a, FinishReason.LENGTH)
    assert step(s).decode_slots == [1] and s.free_slots == [0, 2] and not a.ends_with_its_prompt


def test_speculative_steps_replace_decode_rounds_when_there_is_no_prompt_work():
    s = make(
        num_blocks=64,
        max_num_seqs=2,
        max_num_batched_tokens=16,
        decode_rounds_per_launch=4,
        spec_tokens=2,
        exit_threshold=1.0,
        spec_auto=False,
    )
    assert s.lookahead == 2 * 4 + 2
    a = req("a", 4)
    s.add(a)
    plans = run_prefill(s)
    assert [p.speculate for p in plans] == [False] * 4  # prompt work
    emit(a)
    plan = step(s)
    assert plan.speculate and plan.num_rounds == 1 and plan.decode_slots == [0]
    s.add(req("b", 2, start=200))
    plan = step(s)
    assert not plan.speculate and plan.decode_slots == [0] and chunks(plan) == [("b", 1, 0, 2, 1)]


def test_sampler_mode_follows_running_temperatures():
    s = make(max_num_seqs=2, max_num_batched_tokens=16)
    s.add(req("g", 2))
    assert s.schedule().sampler is SamplerMode.GREEDY
    s.add(req("t", 2, temperature=0.7))
    assert s.schedule().sampler is SamplerMode.SAMPLE


# ------------------------------------------------------------------------------------------ growth, finish


def test_decode_growth_entries_and_finish_frees_everything():
    s = make(num_blocks=32, max_num_seqs=2, max_num_batched_tokens=16)
    a = req("a", 6, 8)
    s.add(a)
    run_prefill(s)
    assert a.block_tables == [[0, 1], [2, 3], [4, 5], [6, 7]] and s.kv.pool.num_free == 24
    growth = []
    for _ in range(4):
        emit(a)
        growth.append(step(s).table_growth)
    # tokens 7, 8: horizon 9, 10 -> 3 blocks (grown at the first); 9, 10: horizon 11, 12 -> still 3.
    assert growth == [[(0, 0, 2, 8), (0, 1, 2, 9), (0, 2, 2, 10), (0, 3, 2, 11)], [], [], []]
    emit(a)  # 11 tokens: horizon min(14, 13) = 13 -> 4 blocks
    assert step(s).table_growth == [(0, 0, 3, 12), (0, 1, 3, 13), (0, 2, 3, 14), (0, 3, 3, 15)]
    emit(a)  # 12 tokens: horizon min(14, 14) = 14 -> 4 blocks: the request's whole length is covered
    assert step(s).table_growth == []
    assert a.block_tables == [[0, 1, 8, 12], [2, 3, 9, 13], [4, 5, 10, 14], [6, 7, 11, 15]]
    assert s.kv.pool.num_free == 16

    s.finish(a, FinishReason.LENGTH)
    assert a.finished and a.slot is None and a.block_tables == [[], [], [], []]
    assert s.kv.pool.num_free == 32 and s.free_slots == [0, 1] and s.owners == [None, None]
    assert s.running == [] and not s.has_unfinished()
    plan = s.schedule()
    assert plan.released == [0] and plan.has_work and plan.decode_slots == []
    assert s.schedule().released == []  # reported once


def test_finished_slot_and_blocks_go_to_the_next_request():
    s = make(num_blocks=16, max_num_seqs=1, max_num_batched_tokens=16)
    a, b = req("a", 4, 2), req("b", 3, 2, start=200)
    s.add(a)
    s.add(b)
    run_prefill(s)
    assert ids(s.waiting) == ["b"] and a.block_tables == [[0, 1], [2, 3], [4, 5], [6, 7]]
    emit(a)
    s.finish(a, FinishReason.STOP)
    assert s.kv.pool.num_free == 16
    plan = s.schedule()
    assert plan.released == [0] and ids(plan.admitted) == ["b"] and b.slot == 0
    assert chunks(plan) == [("b", 0, 0, 3, 1)]
    # Freed blocks go to the back of the free list: b starts on the never-used ones.
    assert b.block_tables == [[8, 9], [10, 11], [12, 13], [14, 15]]
    assert plan.owners == [b]


def test_slots_are_reused_lowest_first():
    s = make(max_num_seqs=3, max_num_batched_tokens=16)
    a, b, c = req("a", 2), req("b", 2), req("c", 2)
    for x in (a, b, c):
        s.add(x)
    s.schedule()
    s.finish(b, FinishReason.ABORT)
    s.finish(a, FinishReason.ABORT)
    assert s.free_slots == [0, 1]
    d = req("d", 2)
    s.add(d)
    plan = s.schedule()
    assert plan.released == [1, 0] and d.slot == 0 and ids(plan.admitted) == ["d"]
    assert plan.owners == [d, None, c]


# --------------------------------------------------------------------------------------------- preemption


def _two_decoding(mode="auto", layout="last_exited", num_blocks=16):
    """a and b (4-token prompts, max_tokens 8) fill a 16-block pool and decode three tokens each."""
    s = make(num_blocks=num_blocks, layout=layout, max_num_seqs=2, max_num_batched_tokens=16, preemption_mode=mode)
    a, b = req("a", 4), req("b", 4, start=200)
    s.add(a)
    s.add(b)
    run_prefill(s)
    emit(a, b)
    for _ in range(2):
        assert step(s).decode_slots == [0, 1]
        emit(a, b)
    return s, a, b


def test_preemption_recompute_picks_the_newest_and_requeues_it():
    s, a, b = _two_decoding()
    assert s.kv.pool.num_free == 0 and (a.num_tokens, b.num_tokens) == (7, 7)
    assert b.block_tables == [[8, 9], [10, 11], [12, 13], [14, 15]]
    plan = step(s)  # a's horizon 9 needs a third block per plane: none is free
    assert plan.released == [1] and plan.decode_slots == [0] and plan.swap_out == []
    assert plan.table_growth == [(0, 0, 2, 8), (0, 1, 2, 9), (0, 2, 2, 10), (0, 3, 2, 11)]  # b's blocks
    assert plan.admitted == [] and plan.owners == [a, None]
    assert (s.num_preemptions, s.num_recomputes) == (1, 1)
    assert b.status is Status.WAITING and b.slot is None and b.num_prefilled == 0
    assert b.block_tables == [[], [], [], []] and b.output_ids == [1, 1, 1]  # its tokens are kept
    assert ids(s.waiting) == ["b"] and ids(s.running) == ["a"] and s.kv.pool.num_free == 4
    # b's readmission prefills prompt + all tokens but the last: 6 positions, horizon 9 -> 12 blocks > 4.
    assert step(s).admitted == [] and ids(s.waiting) == ["b"]
    emit(a)
    s.finish(a, FinishReason.ABORT)
    plan = step(s)
    assert ids(plan.admitted) == ["b"] and plan.released == [0] and b.slot == 0
    assert b.prefill_target == 6 and b.resuming
    assert chunks(plan) == [("b", 0, 0, 6, 1)]
    assert b.block_tables == [[12, 13, 14], [15, 0, 1], [8, 2, 3], [9, 4, 5]]


def test_preemption_requeues_at_the_head_of_the_queue():
    s, a, b = _two_decoding()
    c = req("c", 1, start=300)
    s.add(c)
    step(s)
    assert ids(s.waiting) == ["b", "c"]


def test_preemption_swap_moves_the_newest_to_host_and_back():
    s, a, b = _two_decoding(mode="swap")
    plan = step(s)
    assert len(plan.swap_out) == 1
    out = plan.swap_out[0]
    assert (out.key, out.slot, out.blocks, out.counts) == ("b", 1, [8, 9, 10, 11, 12, 13, 14, 15], [2, 2, 2, 2])
    assert out.seq is b and plan.released == [1] and plan.decode_slots == [0]
    assert plan.table_growth == [(0, 0, 2, 8), (0, 1, 2, 9), (0, 2, 2, 10), (0, 3, 2, 11)]
    assert (s.num_preemptions, s.num_recomputes) == (1, 0)
    assert b.status is Status.SWAPPED and ids(s.swapped) == ["b"] and s.waiting == deque()
    assert s.swap_used == 8 * s.kv.block_bytes == 1024
    assert s.find("b") is b and s.num_unfinished == 2
    # Nobody is admitted while a request is swapped out, and b waits for blocks.
    c = req("c", 1, start=300)
    s.add(c)
    assert step(s).swap_in == [] and step(s).admitted == []
    s.finish(a, FinishReason.ABORT)
    plan = step(s)
    assert plan.released == [0] and len(plan.swap_in) == 1
    back = plan.swap_in[0]
    # The saved 2 blocks per plane come back, plus room up to b's horizon (7 tokens + 2 -> 3 blocks).
    assert (back.key, back.slot, back.tables) == ("b", 0, [[12, 13, 14], [15, 0, 1], [8, 2, 3], [9, 4, 5]])
    assert b.status is Status.RUNNING and b.block_tables is back.tables and s.swap_used == 0
    # Nobody is swapped out any more: c is admitted in the same plan, into the other slot.
    assert plan.decode_slots == [0] and ids(plan.admitted) == ["c"] and c.slot == 1
    assert chunks(plan) == [("c", 1, 0, 1, 1)]


def test_finishing_a_swapped_request_drops_its_copy():
    s, a, b = _two_decoding(mode="swap")
    step(s)
    s.finish(b, FinishReason.ABORT)
    assert s.swapped == deque() and s.swap_used == 0 and b.finished
    plan = s.schedule()
    assert plan.swap_dropped == ["b"] and plan.has_work
    assert s.schedule().swap_dropped == []


def test_swap_falls_back_to_recompute_past_the_swap_budget():
    s, a, b = _two_decoding(mode="swap")
    s.swap_budget = 8 * s.kv.block_bytes - 1
    plan = step(s)
    assert plan.swap_out == [] and (s.num_preemptions, s.num_recomputes) == (1, 1)
    assert b.status is Status.WAITING


def test_a_request_preempts_itself_when_it_is_the_newest():
    s = make(num_blocks=16, max_num_seqs=2, max_num_batched_tokens=16)
    a, b = req("a", 4), req("b", 5, start=200)  # 2 blocks per plane each: the pool is full
    s.add(a)
    s.add(b)
    run_prefill(s)
    emit(a, b)
    assert step(s).released == []
    emit(a, b)  # a: 6 tokens, horizon 8 (covered); b: 7 tokens, horizon 9 (a third block per plane)
    plan = step(s)
    assert plan.released == [1] and plan.decode_slots == [0] and plan.table_growth == []
    assert b.status is Status.WAITING and a.status is Status.RUNNING
    assert [len(t) for t in a.block_tables] == [2] * 4 and s.kv.pool.num_free == 8
    assert (s.num_preemptions, s.num_recomputes) == (1, 1)


def test_requests_in_prefill_are_never_preempted():
    s = make(num_blocks=16, max_num_seqs=2, max_num_batched_tokens=16)
    a = req("a", 4)
    s.add(a)
    run_prefill(s)
    emit(a)
    b = req("b", 6, start=200)  # 6-token prompt, horizon 8: 2 blocks per plane, the other 8 blocks
    s.add(b)
    plan = step(s)
    assert ids(plan.admitted) == ["b"] and s.kv.pool.num_free == 0
    emit(a)
    plan = step(s)  # a (6 tokens, horizon 8) fits
    assert plan.released == []
    emit(a)  # a: 7 tokens, horizon 9: must grow; b is mid-prefill, so a preempts itself
    plan = step(s)
    assert plan.released == [0] and a.status is Status.WAITING and b.status is Status.RUNNING
    assert chunks(plan) == [("b", 1, 0, 6, 3)] and plan.decode_slots == []


# ---------------------------------------------------------------------------------------- shared layout


def test_shared_layout_releases_prefill_planes_after_the_prompt():
    s = make(num_blocks=32, layout="shared", max_num_seqs=1, max_num_batched_tokens=16)
    a = req("a", 6, 8)
    s.add(a)
    run_prefill(s, 3)
    # Planes 0-2 cover the prompt (2 blocks); the last plane up to the horizon 8 (2 blocks).
    assert a.block_tables == [[0, 1], [2, 3], [4, 5], [6, 7]] and s.kv.pool.num_free == 24
    step(s)  # the last loop: only the last plane is kept
    assert a.block_tables == [[], [], [], [6, 7]] and s.kv.pool.num_free == 30
    emit(a)
    assert step(s).table_growth == [(0, 3, 2, 8)]  # 7 tokens, horizon 9: the last plane grows alone


# ---------------------------------------------------------------------------------------- prefix caching


def test_prefix_cache_second_request_reuses_the_first_ones_full_blocks():
    s = make(num_blocks=32, prefix=True, max_num_seqs=2, max_num_batched_tokens=16)
    prefix = s.kv.pool
    a = req("a", 10, 2)
    s.add(a)
    plan = step(s)
    assert chunks(plan) == [("a", 0, 0, 10, 1)] and a.num_cached_tokens == 0
    assert a.block_tables == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    assert prefix.num_entries == 0  # registered only once the prompt ran every loop
    run_prefill(s, 3)
    k0, k1 = a.prompt_keys
    assert len(a.prompt_keys) == 2 and a.cached_keys == [k0, k1]
    assert prefix.num_entries == 2
    assert {k: (prefix.blocks_of(k), prefix.refs(k)) for k in (k0, k1)} == {
        k0: ((0, 3, 6, 9), 1),
        k1: ((1, 4, 7, 10), 1),
    }
    b = req("b", 10, 2)  # the same prompt
    s.add(b)
    emit(a)
    plan = step(s)
    assert ids(plan.admitted) == ["b"] and b.slot == 1
    assert b.block_tables == [[0, 1, 12], [3, 4, 13], [6, 7, 14], [9, 10, 15]]
    assert (b.num_cached_tokens, b.num_prefilled, b.cached_keys) == (8, 8, [k0, k1])
    assert chunks(plan) == [("b", 1, 8, 2, 1)] and plan.decode_slots == [0]
    assert [prefix.refs(k) for k in (k0, k1)] == [2, 2]
    assert (prefix.queried_tokens, prefix.hit_tokens, prefix.hit_rate) == (20, 8, 0.4)
    assert s.kv.pool.num_free == 16

    s.finish(a, FinishReason.LENGTH)  # a's private blocks go back; the entries stay, held by b
    assert s.kv.pool.num_free == 20 and [prefix.refs(k) for k in (k0, k1)] == [1, 1]
    s.finish(b, FinishReason.LENGTH)
    assert s.kv.pool.num_free == 24 and prefix.num_idle_blocks == 8 and s.kv.pool.num_available == 32
    assert [prefix.refs(k) for k in (k0, k1)] == [0, 0]
    prefix.clear_cache()
    assert prefix.num_entries == 0 and s.kv.pool.num_free == 32


def test_prefix_hits_keep_the_last_prompt_token_to_compute():
    s = make(prefix=True, max_num_seqs=2, max_num_batched_tokens=16)
    a = req("a", 8, 2)  # two full blocks
    s.add(a)
    run_prefill(s)
    assert len(a.cached_keys) == 2
    b = req("b", 8, 2)
    s.add(b)
    plan = step(s)
    # (8 - 1) // 4 = 1 block may hit: the second block holds the last token, whose logits are needed.
    assert b.num_cached_tokens == 4 and chunks(plan)[-1] == ("b", 1, 4, 4, 1)
    assert b.block_tables[0][0] == a.block_tables[0][0] and b.block_tables[0][1] != a.block_tables[0][1]


def test_concurrent_identical_prompts_do_not_share_until_registered():
    s = make(prefix=True, max_num_seqs=2, max_num_batched_tokens=32)
    a, b = req("a", 10, 2), req("b", 10, 2)
    s.add(a)
    s.add(b)
    plan = step(s)
    assert chunks(plan) == [("a", 0, 0, 10, 1), ("b", 1, 0, 10, 1)]
    assert b.num_cached_tokens == 0 and b.block_tables[0] == [12, 13, 14]
    run_prefill(s, 3)
    # a registers first; b's identical keys are taken, so its blocks stay private.
    assert len(a.cached_keys) == 2 and b.cached_keys == []
    assert s.kv.pool.num_entries == 2
    assert [s.kv.pool.blocks_of(k) for k in a.cached_keys] == [(0, 3, 6, 9), (1, 4, 7, 10)]
    s.finish(b, FinishReason.ABORT)
    assert s.kv.pool.num_free == 32 - 12


def test_admission_counts_idle_cached_blocks_as_available_and_evicts_them():
    s = make(num_blocks=16, prefix=True, max_num_seqs=1, max_num_batched_tokens=16)
    a = req("a", 5, 2)  # 1 full block is cached; horizon 7 -> 2 blocks per plane
    s.add(a)
    run_prefill(s)
    s.finish(a, FinishReason.LENGTH)
    prefix = s.kv.pool
    assert prefix.num_entries == 1 and prefix.num_idle_blocks == 4 and s.kv.pool.num_free == 12
    b = req("b", 14, 2, start=500)  # no hit; horizon 16 -> 16 blocks: the idle entry must go
    s.add(b)
    plan = step(s)
    assert ids(plan.admitted) == ["b"] and prefix.num_entries == 0 and s.kv.pool.num_free == 0
    assert b.block_tables == [[8, 9, 10, 11], [12, 13, 14, 15], [1, 3, 5, 7], [0, 2, 4, 6]]


def test_recompute_readmission_rehits_its_own_cached_prefix_without_counting_it():
    s = make(num_blocks=16, prefix=True, max_num_seqs=2, max_num_batched_tokens=16)
    prefix = s.kv.pool
    a, b = req("a", 5), req("b", 5, start=200)  # one full block each, 2 blocks per plane: the pool is full
    s.add(a)
    s.add(b)
    run_prefill(s)
    assert len(a.cached_keys) == 1 and len(b.cached_keys) == 1 and s.kv.pool.num_free == 0
    b_entry = prefix.blocks_of(b.cached_keys[0])
    assert b_entry == (8, 10, 12, 14)
    emit(a, b)
    assert step(s).decode_slots == [0, 1]
    emit(a, b)
    plan = step(s)  # a (7 tokens, horizon 9) grows: b is preempted; its entry stays, idle
    assert plan.released == [1] and b.status is Status.WAITING and b.cached_keys == []
    assert prefix.num_idle_blocks == 4 and s.kv.pool.num_free == 0  # b's 4 private blocks went to a
    assert plan.table_growth == [(0, 0, 2, 9), (0, 1, 2, 11), (0, 2, 2, 13), (0, 3, 2, 15)]
    emit(a)
    s.finish(a, FinishReason.ABORT)
    plan = step(s)
    assert ids(plan.admitted) == ["b"] and b.prefill_target == 6
    assert chunks(plan) == [("b", 0, 4, 2, 1)]  # its own cached first block is not recomputed
    assert [t[0] for t in b.block_tables] == list(b_entry) and prefix.refs(b.cached_keys[0]) == 1
    # A resumed request's hit is neither reported nor counted in the hit rate: only first admissions are.
    assert b.num_cached_tokens == 0
    assert (prefix.queried_tokens, prefix.hit_tokens) == (10, 0)


def test_prefill_chunk_dataclass():
    seq = req("x", 3)
    seq.slot = 5
    c = PrefillChunk(seq, 0, 3)
    assert (c.loop, c.slot) == (1, 5)
