"""Failure isolation (docs/engine.md, "Failure isolation"): a request whose own work raises inside a step
ends alone, with its error, while every other request gets exactly the tokens it gets without it; a failed
batched launch ends only the requests of that launch; requests that exceed an engine limit are refused at
add_request. The KV cache is whole afterwards."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess

import pytest
from engine_helpers import BATCH_PROMPTS as PROMPTS
from engine_helpers import alone, assert_same, drive
from engine_helpers import make_plain_engine as make_engine
from helpers import Inbox

from ouro_backend import LLM, RequestError, SamplingParams
from ouro_backend.config import EngineConfig
from ouro_backend.engine.decode_state import MAX_TRACE, DecodeState
from ouro_backend.engine.sequence import Sequence

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)  # exit_threshold: the engine's 0.7
BAD = dataclasses.replace(GREEDY)  # the same values; its identity marks the faulty request's row
REQUESTS = [(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS)] + [("bad", PROMPTS[1][::-1], BAD)]
GOOD = [r for r in REQUESTS if r[0] != "bad"]
SCHEDULING = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
_REF: dict = {}


def without_bad(toy_path, async_scheduling):
    """The good requests' outputs in the same engine configuration, with no faulty request at all."""
    if async_scheduling not in _REF:
        _REF[async_scheduling] = drive(make_engine(toy_path, async_scheduling=async_scheduling), GOOD).final
    return _REF[async_scheduling]


def check_isolated(eng, run, ref, match):
    """Only 'bad' failed, with its error; every other request equals its run without it; nothing leaked."""
    bad = run.final["bad"]
    assert bad.finished and bad.finish_reason == "error" and match in bad.error
    for rid, _, _ in GOOD:
        assert_same(run.final[rid], ref[rid], rid)
    assert eng.stats()["num_failed"] == 1
    assert eng.kv.pool.num_available == eng.kv.num_blocks and not eng.runner.swap.saved
    assert not eng.has_unfinished_requests() and eng.get_num_unfinished_requests() == 0


def raise_for(original, when=lambda seq: True):
    """`original(seq, ...)`, except that it raises for request 'bad' once `when(seq)`."""

    def fn(seq, *args, **kw):
        if seq.request_id == "bad" and when(seq):
            raise RuntimeError("injected fault in bad")
        return original(seq, *args, **kw)

    return fn


@SCHEDULING
def test_fault_while_staging_the_admitted_row_ends_that_request_only(toy_path, async_scheduling, monkeypatch):
    eng = make_engine(toy_path, async_scheduling=async_scheduling)
    host_row = DecodeState.host_row

    def faulty(row, *args):
        if row.params is BAD:
            raise RuntimeError("injected fault in bad")
        return host_row(row, *args)

    monkeypatch.setattr(DecodeState, "host_row", staticmethod(faulty))
    run = drive(eng, REQUESTS)
    check_isolated(eng, run, without_bad(toy_path, async_scheduling), "injected fault in bad")
    assert run.final["bad"].token_ids == []


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("exit_trace", [2] * (MAX_TRACE + 1), f"exit_trace has {MAX_TRACE + 1} depths; at most {MAX_TRACE}"),
        ("temperature", 10**400, "OverflowError"),
        ("top_k", 2**63, r"TOP_K \(9223372036854775808\) does not fit"),
    ],
)
def test_a_value_the_row_cannot_hold_fails_its_request_at_staging(toy_path, field, value, match):
    """No fault injected: a value changed after add_request validated it reaches the row's staging
    (`DecodeState.host_row`), which refuses it for that request alone."""
    eng = make_engine(toy_path, async_scheduling=True)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    run = drive(
        eng,
        REQUESTS[:-1] + [("bad", REQUESTS[-1][1], params)],
        hook=lambda eng, step, run: step == 0 and setattr(params, field, value),
    )
    check_isolated(eng, run, without_bad(toy_path, True), "")
    assert run.final["bad"].token_ids == [] and re.search(match, run.final["bad"].error)


@SCHEDULING
@pytest.mark.parametrize("where", ["append", "make_output"])
def test_fault_mid_generation_ends_that_request_only(toy_path, async_scheduling, where, monkeypatch):
    """After its 4th token: the request has streamed tokens, and its row is on the device, maybe in the
    launch in flight."""
    eng = make_engine(toy_path, async_scheduling=async_scheduling)

    def late(seq):
        return len(seq.output_ids) >= 4

    if where == "append":
        monkeypatch.setattr(Sequence, "append_token", raise_for(Sequence.append_token, late))
    else:
        monkeypatch.setattr(Sequence, "make_output", raise_for(Sequence.make_output, late))
    run = drive(eng, REQUESTS, arrivals={"bad": 2})
    check_isolated(eng, run, without_bad(toy_path, async_scheduling), "injected fault in bad")
    assert run.streamed("bad"), "it streamed tokens before it failed"
    assert len(run.final["bad"].token_ids) < GREEDY.max_tokens


SWAP_PROMPTS = [[10 + i, 200 + 7 * i, 3 * i + 1, 900 - i] for i in range(8)]
SWAP_PARAMS = SamplingParams(max_tokens=28, temperature=0.0, ignore_eos=True, exit_threshold=1.0)


@SCHEDULING
@pytest.mark.parametrize("step", ["save", "restore"])
def test_fault_in_a_swap_ends_the_swapped_request_only(toy_path, async_scheduling, step):
    """The cache holds a quarter of the requests' whole lengths (tests/test_kv_memory.py), so the newest are
    swapped out and back in; the first request whose swap copy (out, or back in) raises ends alone."""
    eng = make_engine(toy_path, num_blocks=128, preemption_mode="swap", async_scheduling=async_scheduling)
    victims = []
    original = getattr(eng.runner.swap, step)

    def faulty(key, *args):
        if not victims:
            victims.append(key)
            raise RuntimeError(f"injected fault in {key}")
        return original(key, *args)

    setattr(eng.runner.swap, step, faulty)
    run = drive(eng, [(str(i), p, SWAP_PARAMS) for i, p in enumerate(SWAP_PROMPTS)])
    assert len(victims) == 1, "a request was swapped"
    for i, p in enumerate(SWAP_PROMPTS):
        out = run.final[str(i)]
        if str(i) == victims[0]:
            assert out.finish_reason == "error" and "injected fault" in out.error
        else:
            assert_same(out, alone(toy_path, p, SWAP_PARAMS), f"request {i}")
    assert eng.stats()["num_failed"] == 1 and eng.stats()["swap_bytes"] == 0
    assert eng.kv.pool.num_available == eng.kv.num_blocks and not eng.runner.swap.saved


@SCHEDULING
def test_failed_batched_launch_ends_its_requests_not_the_waiting_ones(toy_path, async_scheduling, monkeypatch):
    """A fault inside the batched device work belongs to no single request: the requests running in that
    launch end with its error; the ones still waiting for a slot run afterwards as if nothing happened."""
    eng = make_engine(toy_path, max_num_seqs=2, async_scheduling=async_scheduling)
    loop = eng.model.loop
    calls = []

    def faulty(*args):
        calls.append(1)
        if len(calls) == 7:  # the prompts' 4 loops ran; now their decode rounds
            raise RuntimeError("injected device fault")
        return loop(*args)

    monkeypatch.setattr(eng.model, "loop", faulty)
    requests = [(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS[:4])]
    run = drive(eng, requests)
    failed = {rid for rid, out in run.final.items() if out.finish_reason == "error"}
    assert failed == {"r0", "r1"}, "the two running requests, not the two waiting"
    assert all("injected device fault" in run.final[rid].error for rid in failed)
    for rid, prompt, params in requests[2:]:
        assert_same(run.final[rid], alone(toy_path, prompt, params), rid)
    assert eng.stats()["num_failed"] == 2
    assert eng.kv.pool.num_available == eng.kv.num_blocks and eng.get_num_unfinished_requests() == 0


# ---- limits, refused at add_request
@pytest.fixture(scope="module")
def trace_engine(toy_path):
    return make_engine(toy_path, exit_mode="trace")


def test_exit_trace_longer_than_the_decode_state_is_refused(trace_engine):
    with pytest.raises(RequestError, match=f"exit_trace has {MAX_TRACE + 1} depths; at most {MAX_TRACE}"):
        trace_engine.add_request("long-trace", PROMPTS[0], SamplingParams(exit_trace=[2] * (MAX_TRACE + 1)))
    assert not trace_engine.has_unfinished_requests()
    # The longest allowed trace runs, cycled over the tokens.
    trace = [1 + i % 4 for i in range(MAX_TRACE)]
    run = drive(trace_engine, [("t", PROMPTS[0], SamplingParams(max_tokens=8, ignore_eos=True, exit_trace=trace))])
    assert run.final["t"].finish_reason == "length"
    assert run.final["t"].exit_depths[1:] == trace[:7]  # the first token comes from the prompt (depth 4)


@pytest.mark.parametrize(
    "params, match",
    [
        (dict(top_k=1025), r"top_k \(1025\) exceeds the vocabulary size \(1024\)"),
        (dict(top_k=2**63), "top_k"),
        (dict(stop_token_ids=[3, 1024]), r"stop_token_ids has id 1024 outside the vocabulary \[0, 1024\)"),
        (dict(exit_trace=[5]), "exit_trace depths must be <= 4"),
        (dict(max_loops=5), "max_loops"),
        (dict(min_loops=5), "min_loops"),
    ],
)
def test_values_beyond_the_engines_limits_are_refused(trace_engine, params, match):
    p = SamplingParams(**params)  # valid on its own: the limits are the engine's
    with pytest.raises(RequestError, match=match):
        trace_engine.add_request("x", PROMPTS[0], p)


@pytest.mark.parametrize(
    "params, match",
    [
        (dict(temperature=10**400), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(ignore_eos="yes"), "ignore_eos"),
        (dict(exit_trace=[]), "exit_trace"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
    ],
)
def test_values_no_engine_can_hold_are_refused(params, match):
    with pytest.raises(RequestError, match=match):
        SamplingParams(**params)


def test_a_field_changed_after_construction_is_checked_again(trace_engine):
    p = SamplingParams()
    p.exit_trace = [1] * (MAX_TRACE + 1)
    with pytest.raises(RequestError, match="exit_trace"):
        trace_engine.add_request("y", PROMPTS[0], p)
    with pytest.raises(RequestError, match="prompt must be a string or a list of token ids"):
        trace_engine.add_request("z", 42, SamplingParams())


# ---- through the engine process
HELPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "faulty_engine_process.py")


def test_engine_process_fails_only_the_faulty_request(toy_path, monkeypatch):
    """tests/faulty_engine_process.py is the engine process with a fault in the token bookkeeping of
    requests named faulty*: that request gets Failed([its id], message) while the requests beside it
    stream to the end with the tokens they get without it, and the engine serves on."""
    from faulty_engine_process import AFTER

    from ouro_backend.serving import engine_auth, engine_client

    popen = subprocess.Popen

    def start_helper(args, **kw):
        assert args[1:3] == ["-m", engine_client.SERVER_MODULE]
        return popen([args[0], HELPER, *args[3:]], **kw)

    inbox = Inbox()
    config = EngineConfig(model=toy_path, device="cpu", dtype="float32", max_num_seqs=8)
    with monkeypatch.context() as m:
        m.setattr(engine_client.subprocess, "Popen", start_helper)
        client, proc = engine_client.start_engine_process(
            config,
            engine_auth.engine_address("faulty", os.getpid()),
            inbox.on_message,
            lambda: None,
            metrics_interval_s=0.1,
        )
    try:
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        prompts = {"ok0": [5, 6, 7, 8], "faulty": [9, 10, 11], "ok1": [12, 13, 14, 15, 16]}
        for rid, prompt in prompts.items():
            client.add(rid, prompt, params)
        inbox.pump(lambda: {"ok0", "ok1"} <= set(inbox.reasons) and "faulty" in inbox.failed)
        assert "injected fault in faulty" in inbox.failed["faulty"]
        assert "faulty" not in inbox.reasons and len(inbox.tokens.get("faulty", [])) <= AFTER
        ref = LLM(model=toy_path, device="cpu", dtype="float32").generate([prompts["ok0"], prompts["ok1"]], params)
        assert [inbox.tokens["ok0"], inbox.tokens["ok1"]] == [r.token_ids for r in ref]
        assert inbox.reasons == {"ok0": "length", "ok1": "length"}
        client.add("after", prompts["faulty"], params)  # the engine still serves, the same prompt included
        inbox.pump(lambda: "after" in inbox.reasons)
        assert len(inbox.tokens["after"]) == params.max_tokens
        inbox.pump(
            lambda: (
                inbox.stats
                and inbox.stats[-1].stats
                and inbox.stats[-1].stats["num_running"] == 0
                and inbox.stats[-1].stats["kv_usage"] == 0
                and inbox.stats[-1].stats["num_failed"] == 1
            )
        )
        assert sum(s.counters.get("errors", 0) for s in inbox.stats) == 1
    finally:
        client.close()
        proc.wait(timeout=30)
