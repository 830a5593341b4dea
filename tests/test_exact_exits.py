"""Early exits are exact under batching: every request gets what it would get alone, and what the oracle says.

Only the public API is used (LLMEngine / EngineConfig / SamplingParams / RequestOutput, `stats()`, the KV
allocator's free count, and the dense oracle), so these tests hold for any engine internals.

What is shown, for every exit mode and both KV layouts, with synchronous and asynchronous scheduling:
- a batch of requests with different exit thresholds, loop bounds and traces gives each request the tokens,
  exit depths and logprobs it gets alone in a fresh engine;
- those outputs are the dense oracle's: its logits at the engine's own depths pick the same greedy tokens with
  the same logprobs, and the depths follow the exit rule applied to the oracle's gate values;
- the same holds when requests arrive while others are mid-stream, when one is aborted mid-token, when
  requests stop on a stop string, EOS, a stop token or max_tokens, and for seeded sampling.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from engine_helpers import BATCH_PROMPTS as PROMPTS
from engine_helpers import ENGINE_THRESHOLD, Run, alone, assert_same, drive
from engine_helpers import make_plain_engine as make_engine

from ouro_backend import LLMEngine, SamplingParams

T = 4  # the toy model's loops (total_ut_steps)
LAYOUTS = ["last_exited", "shared"]
MODES = ["ouro", "ouro_delayed", "random_lookahead", "trace", "fixed"]
ASYNC = [pytest.param(False, id="sync"), pytest.param(True, id="async")]


# ---------------------------------------------------------------------------------------------- helpers
def busy_engine(toy_path, **kw) -> LLMEngine:
    """An engine that must interleave: at most 4 running requests, prompts in chunks of 5 tokens."""
    kw = dict(dict(max_num_seqs=4, max_num_batched_tokens=16, prefill_chunk_size=5), **kw)
    return make_engine(toy_path, **kw)


def assert_prefix(got, ref, n, what=""):
    """got is ref's first n tokens (a stopped or aborted request)."""
    assert got.token_ids == ref.token_ids[:n], what
    assert got.exit_depths == ref.exit_depths[:n], what
    assert np.allclose(got.logprobs, ref.logprobs[:n], atol=1e-5, rtol=0), what


def decode_depths(outs) -> set[int]:
    """Depths of tokens produced by decode steps (the first token of a request comes from its prompt)."""
    return {d for o in outs for d in o.exit_depths[1:]}


def gate_rule_depth(gates, threshold, min_loops=1, max_loops=T, delay=0):
    """The exit rule of docs/model.md on gate values, written out independently of the engine.

    remaining *= 1 - lam_r in fp32; the rule fires after loop r when r >= max_loops, or when threshold < 1,
    r >= min_loops and 1 - remaining >= threshold. delay=1 is ouro_delayed: a decision reached after loop r
    applies after loop r+1 (still capped by max_loops). Returns the exit loop, or None if the rule does not
    fire within `gates`.
    """
    one = np.float32(1.0)
    remaining, decided = one, None
    for r, lam in enumerate(gates, start=1):
        remaining = np.float32(remaining * (one - np.float32(lam)))
        if decided is None and threshold < 1 and r >= min_loops and float(one - remaining) >= threshold:
            decided = r
        if r >= max_loops or (decided is not None and r >= decided + delay):
            return r
    return None


def bounds_of(params):
    threshold = ENGINE_THRESHOLD if params.exit_threshold is None else params.exit_threshold
    return threshold, params.min_loops, params.max_loops or T


_ORACLE: dict = {}


def oracle_pass(oracle, prompt, out, layout):
    """The oracle run over prompt + generated tokens, each generated token at the engine's depth.

    exit_depths[k] is the depth of the loop that produced token k, i.e. how many loops the input before it
    ran: the prompt's last token (always T) for k = 0, generated token k-1 for k >= 1. So input position
    len(prompt)-1+k ran exit_depths[k] loops, and its logits (and gates) belong to token k.
    """
    key = (tuple(prompt), tuple(out.token_ids), tuple(out.exit_depths), layout)
    if key not in _ORACLE:
        seq = prompt + out.token_ids[:-1]
        loops = [T] * len(prompt) + out.exit_depths[1:]
        _ORACLE[key] = oracle.forward(seq, len(prompt), loops, layout)
    return _ORACLE[key]


def check_against_oracle(oracle, prompt, out, layout, greedy=True):
    """Greedy tokens are the argmax of the oracle's logits at the engine's depths; logprobs are its log_softmax.
    Returns the oracle's gate values per generated token (index k: the gates of the loops that produced it)."""
    res = oracle_pass(oracle, prompt, out, layout)
    p = len(prompt)
    assert out.exit_depths[0] == T, "the first token comes from the prompt, which runs all loops"
    gates = []
    for k, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        logits = res.logits[p - 1 + k]
        if greedy:
            assert int(logits.argmax()) == tok, (k, out.exit_depths)
        assert math.isclose(lp, float(torch.log_softmax(logits, -1)[tok]), abs_tol=1e-4), k
        assert len(res.gates[p - 1 + k]) == out.exit_depths[k]
        gates.append(res.gates[p - 1 + k])
    return gates


# ------------------------------------------------------------------------------------- the mixed batch
def mixed_params(mode) -> list[SamplingParams]:
    """One request per prompt, each with its own exit settings and length (all greedy, no EOS stops)."""

    def sp(max_tokens, **kw):
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)

    if mode == "trace":
        traces = [[1, 3, 2, 4], [2], [4, 1], [3, 3, 1], [1], [2, 4], [1, 2, 3]]
        thresholds = [0.5, None, 0.3, 1.0, 0.9, 0.0, 0.6]  # irrelevant in trace mode
        return [sp(6 + i % 4, exit_trace=t, exit_threshold=th) for i, (t, th) in enumerate(zip(traces, thresholds))]
    if mode == "fixed":
        loops = [(1, 1), (1, 2), (2, 3), (1, 4), (1, None), (2, 2), (3, 3)]  # (min_loops, max_loops)
        thresholds = [0.5, 0.9, 0.3, 1.0, None, 0.0, 0.6]  # ignored: fixed depth is max_loops
        return [
            sp(6 + i % 4, min_loops=lo, max_loops=hi, exit_threshold=th)
            for i, ((lo, hi), th) in enumerate(zip(loops, thresholds))
        ]
    return [  # gate modes: ouro, ouro_delayed, random_lookahead
        sp(8, exit_threshold=0.5),
        sp(10, exit_threshold=0.8, min_loops=2),
        sp(7, exit_threshold=0.3, max_loops=3),
        sp(9, exit_threshold=1.0),  # full depth (decided without gates)
        sp(6, exit_threshold=0.6, min_loops=2, max_loops=3),
        sp(8, exit_threshold=0.0, min_loops=2),  # exits as soon as the bounds allow
        sp(7),  # the engine's threshold
    ]


def mixed_requests(mode):
    return [(f"r{i}", prompt, params) for i, (prompt, params) in enumerate(zip(PROMPTS, mixed_params(mode)))]


_BATCH: dict = {}


def mixed_batch(toy_path, layout, mode, async_scheduling) -> Run:
    """The mixed batch, all requests added at once into a busy engine (cached for the oracle tests)."""
    key = (layout, mode, async_scheduling)
    if key not in _BATCH:
        eng = busy_engine(toy_path, kv_layout=layout, exit_mode=mode, async_scheduling=async_scheduling)
        _BATCH[key] = drive(eng, mixed_requests(mode))
    return _BATCH[key]


@pytest.mark.parametrize("async_scheduling", ASYNC)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_mixed_batch_equals_alone(toy_path, layout, mode, async_scheduling):
    """Requests with different thresholds, loop bounds and traces, batched (4 at a time, prompts chunked
    between decode rows), each get exactly their alone output; the batch really mixes depths."""
    run = mixed_batch(toy_path, layout, mode, async_scheduling)
    for rid, prompt, params in mixed_requests(mode):
        out = run.final[rid]
        assert out.finish_reason == "length" and len(out.token_ids) == params.max_tokens
        assert_same(out, alone(toy_path, prompt, params, kv_layout=layout, exit_mode=mode), (rid, mode, layout))
    assert len(decode_depths(run.final.values())) >= 2, "the batch should mix decode depths"
    assert 2 <= run.max_running <= 4, "requests should run together, at most max_num_seqs at once"


@pytest.mark.parametrize("async_scheduling", ASYNC)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_mixed_batch_matches_oracle(toy_path, oracle, layout, mode, async_scheduling):
    """The batched outputs are the model's: at the engine's own depths the dense oracle picks the same greedy
    tokens with the same logprobs, and the depths are those of the mode's rule:
    ouro / ouro_delayed: the gate rule of docs/model.md on the oracle's gate values with each request's threshold and
    loop bounds; fixed: max_loops; trace: the request's trace, cycled; random_lookahead (an untrained gate
    whose weights the oracle does not have): within the loop bounds, at least one loop after firing."""
    run = mixed_batch(toy_path, layout, mode, async_scheduling)
    for rid, prompt, params in mixed_requests(mode):
        out = run.final[rid]
        gates = check_against_oracle(oracle, prompt, out, layout)
        threshold, lo, hi = bounds_of(params)
        depths = out.exit_depths[1:]
        if mode in ("ouro", "ouro_delayed"):
            delay = 1 if mode == "ouro_delayed" else 0
            for k, g in enumerate(gates[1:], start=1):
                assert gate_rule_depth(g, threshold, lo, hi, delay) == len(g), (rid, k, g)
        elif mode == "fixed":
            assert depths == [hi] * len(depths), rid
        elif mode == "trace":
            trace = params.exit_trace
            assert depths == [trace[k % len(trace)] for k in range(len(depths))], rid
        else:
            assert all(max(lo, min(2, hi)) <= d <= hi for d in depths), (rid, depths)


@pytest.mark.parametrize("mode", ["ouro", "ouro_delayed"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gate_depths_equal_oracle_generate(toy_path, oracle, layout, mode):
    """Independently of the engine's depths: the oracle's own greedy generation, deciding each token's depth
    from its gates with the request's threshold and loop bounds, gives the batch's tokens and depths
    (short requests, since the oracle recomputes everything per token)."""
    run = mixed_batch(toy_path, layout, mode, True)
    delay = 1 if mode == "ouro_delayed" else 0
    for i in (1, 2, 6):  # threshold 0.8 with min_loops=2; 0.3 with max_loops=3; the engine's threshold
        rid, prompt, params = mixed_requests(mode)[i]
        threshold, lo, hi = bounds_of(params)
        tokens, depths = oracle.generate(
            prompt, params.max_tokens, layout=layout, exit_fn=lambda g: gate_rule_depth(g, threshold, lo, hi, delay)
        )
        assert (run.final[rid].token_ids, run.final[rid].exit_depths) == (tokens, depths), rid
        assert len(set(depths[1:])) >= 2, "this request should exit at different depths"


# ----------------------------------------------------------------------------------- staggered arrivals
@pytest.mark.parametrize("async_scheduling", ASYNC)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_staggered_arrivals_equal_alone(toy_path, layout, mode, async_scheduling):
    """Requests arriving every 2-3 steps, while earlier ones are mid-stream (and some wait for a row), get
    exactly their alone outputs."""
    requests = mixed_requests(mode)
    arrivals = {rid: s for (rid, _, _), s in zip(requests, [0, 2, 5, 7, 10, 12, 15])}
    eng = busy_engine(toy_path, kv_layout=layout, exit_mode=mode, async_scheduling=async_scheduling)
    run = drive(eng, requests, arrivals)
    for rid, prompt, params in requests:
        assert_same(run.final[rid], alone(toy_path, prompt, params, kv_layout=layout, exit_mode=mode), rid)
    assert sum(1 for n in run.midstream_at_arrival.values() if n) >= 3, "arrivals should meet running streams"
    assert len(decode_depths(run.final.values())) >= 2


# ----------------------------------------------------------------------------------------------- aborts
@pytest.mark.parametrize("extra_steps", [0, 1, 2, 3])
@pytest.mark.parametrize("async_scheduling", ASYNC)
@pytest.mark.parametrize("mode", ["ouro", "trace"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_abort_mid_token(toy_path, layout, mode, async_scheduling, extra_steps):
    """A request aborted mid-stream: its next step reports it finished ('abort') with exactly the tokens
    streamed before the abort (its alone output's prefix), nothing comes after, the others are unaffected,
    the KV is free and the abort is counted. The victim's tokens take 4 loops, and it is aborted 0-3 steps
    after its third token came out, so the abort lands at different loops of the token in flight."""
    others = mixed_requests(mode)[:4]
    if mode == "trace":
        victim = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, exit_trace=[4])
    else:
        victim = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, exit_threshold=1.0)
    requests = others[:2] + [("victim", PROMPTS[5], victim)] + others[2:]
    state = {}

    def hook(eng, step, run):
        if "abort_at" not in state and len(run.streamed("victim")) >= 3:
            state["abort_at"] = step + extra_steps
        if state.get("abort_at") == step:
            assert "victim" not in run.final, "the victim should still be running"
            state["before"] = run.streamed("victim")
            eng.abort_request("victim")

    eng = busy_engine(toy_path, kv_layout=layout, exit_mode=mode, async_scheduling=async_scheduling)
    run = drive(eng, requests, hook=hook)
    final = run.final["victim"]
    assert final.finish_reason == "abort"
    assert run.final_step["victim"] == state["abort_at"], "the abort is reported by the next step"
    assert final.token_ids == state["before"] and final.new_token_ids == []
    assert 3 <= len(final.token_ids) < victim.max_tokens, "the victim was aborted mid-stream"
    ref = alone(toy_path, PROMPTS[5], victim, kv_layout=layout, exit_mode=mode)
    assert_prefix(final, ref, len(final.token_ids))
    for rid, prompt, params in others:
        assert_same(run.final[rid], alone(toy_path, prompt, params, kv_layout=layout, exit_mode=mode), rid)
    assert eng.stats()["num_aborted"] == 1
    assert len(decode_depths(run.final[r] for r, _, _ in others)) >= 2


@pytest.mark.parametrize("async_scheduling", ASYNC)
def test_abort_while_waiting(toy_path, async_scheduling):
    """A request aborted before it got a row finishes ('abort') with no tokens; the running ones are
    unaffected and nothing leaks."""
    requests = mixed_requests("ouro")[:3]
    aborted = {}

    def hook(eng, step, run):
        if step == 2:
            aborted["before"] = run.streamed("r2")
            eng.abort_request("r2")

    eng = busy_engine(toy_path, max_num_seqs=2, async_scheduling=async_scheduling)
    run = drive(eng, requests, hook=hook)
    assert aborted["before"] == [] and run.final["r2"].finish_reason == "abort"
    assert run.final["r2"].token_ids == [] and run.final_step["r2"] == 2
    for rid, prompt, params in requests[:2]:
        assert_same(run.final[rid], alone(toy_path, prompt, params), rid)
    assert eng.stats()["num_aborted"] == 1


# ---------------------------------------------------------------------------------------- stop conditions
N_REF = 12  # length of the unstopped reference runs


def expected_stop(ref, params, eos, tokenizer):
    """(length, finish_reason, text) a request must end with, from its unstopped greedy reference: the first
    token that is EOS (unless ignore_eos) or a stop token, or after which the text contains a stop string;
    else max_tokens. The text is cut before the stop string."""
    for k in range(1, params.max_tokens + 1):
        tok = ref.token_ids[k - 1]
        if (tok in eos and not params.ignore_eos) or tok in params.stop_token_ids:
            return k, "stop", tokenizer.decode(ref.token_ids[:k])
        text = tokenizer.decode(ref.token_ids[:k])
        hits = [text.find(s) for s in params.stop if s in text]
        if hits:
            return k, "stop", text[: min(hits)]
    return params.max_tokens, "length", tokenizer.decode(ref.token_ids[: params.max_tokens])


def first_new_token_at(tokens, lo=2):
    """A token whose first occurrence in `tokens` is at index >= lo and before the end."""
    for j in range(lo, len(tokens) - 1):
        if tokens.index(tokens[j]) == j:
            return tokens[j]
    raise AssertionError(f"no token first occurs at index >= {lo} in {tokens}")


@pytest.mark.parametrize("async_scheduling", ASYNC)
@pytest.mark.parametrize("mode", ["ouro", "trace"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_stops_in_an_early_exit_batch(toy_path, layout, mode, async_scheduling):
    """max_tokens 1 and 2, a stop token, EOS, a stop string and plain requests in one early-exit batch: each
    output is its unstopped reference cut at the right token with the right finish reason and text, and the
    requests that do not stop are unaffected."""
    kw = dict(kv_layout=layout, exit_mode=mode)
    exits = [
        dict(exit_threshold=0.5),
        dict(exit_threshold=0.8, min_loops=2),
        dict(exit_threshold=0.3, max_loops=3),
        dict(exit_threshold=0.6),
        dict(),
    ]
    if mode == "trace":
        exits = [dict(exit_trace=t) for t in ([1, 3, 2, 4], [2], [4, 1], [3, 1], [1, 2])]

    def ref_of(i):
        p = SamplingParams(max_tokens=N_REF, temperature=0.0, ignore_eos=True, **exits[i % len(exits)])
        return alone(toy_path, PROMPTS[i], p, **kw)

    tokenizer = make_engine(toy_path).tokenizer
    eos_tok = first_new_token_at(ref_of(3).token_ids)
    stop_tok = first_new_token_at(ref_of(2).token_ids, lo=3)
    text = tokenizer.decode(ref_of(4).token_ids)
    visible = text.replace("\ufffd", "")
    stop_str = visible[len(visible) // 2 : len(visible) // 2 + 2]
    assert stop_str and stop_str in text

    def sp(i, **kw2):
        return SamplingParams(temperature=0.0, **exits[i % len(exits)], **kw2)

    requests = [
        ("max1", PROMPTS[0], sp(0, max_tokens=1, ignore_eos=True)),
        ("max2", PROMPTS[1], sp(1, max_tokens=2, ignore_eos=True)),
        ("stop_tok", PROMPTS[2], sp(2, max_tokens=N_REF, ignore_eos=True, stop_token_ids=[stop_tok])),
        ("eos", PROMPTS[3], sp(3, max_tokens=N_REF)),
        ("stop_str", PROMPTS[4], sp(4, max_tokens=N_REF, ignore_eos=True, stop=[stop_str])),
        ("plain", PROMPTS[5], sp(5, max_tokens=10, ignore_eos=True)),
        ("eos_too", PROMPTS[6], sp(6, max_tokens=N_REF)),  # stops if it happens to produce the EOS token
    ]
    eng = busy_engine(toy_path, eos_token_ids=[eos_tok], async_scheduling=async_scheduling, **kw)
    run = drive(eng, requests, arrivals={"plain": 3, "eos_too": 6})
    lengths = {}
    for i, (rid, _prompt, params) in enumerate(requests):
        ref = ref_of(i)
        n, reason, want_text = expected_stop(ref, params, {eos_tok}, tokenizer)
        out = run.final[rid]
        assert (len(out.token_ids), out.finish_reason) == (n, reason), rid
        assert_prefix(out, ref, n, rid)
        assert out.text == want_text, rid
        lengths[rid] = n
    assert lengths["max1"] == 1 and lengths["max2"] == 2
    for rid in ("stop_tok", "eos", "stop_str"):
        assert 2 <= lengths[rid] < N_REF and run.final[rid].finish_reason == "stop", (rid, lengths[rid])
    assert run.final["plain"].finish_reason == "length"
    assert len(decode_depths(run.final.values())) >= 2


# --------------------------------------------------------------------------------------- seeded sampling
SAMPLED = [
    SamplingParams(max_tokens=10, temperature=0.9, seed=11, top_k=20, ignore_eos=True, exit_threshold=0.5),
    SamplingParams(max_tokens=9, temperature=1.2, seed=12, top_p=0.8, ignore_eos=True, exit_threshold=0.6, min_loops=2),
    SamplingParams(
        max_tokens=8, temperature=0.7, seed=13, top_k=50, top_p=0.9, ignore_eos=True, exit_threshold=0.3, max_loops=3
    ),
]


@pytest.mark.parametrize("async_scheduling", ASYNC)
@pytest.mark.parametrize("mode", ["ouro", "ouro_delayed"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_seeded_sampling_equals_alone(toy_path, oracle, layout, mode, async_scheduling):
    """Seeded requests (temperature, top-k, top-p) with early exit draw the same tokens at the same depths
    alone and in a busy batch with staggered arrivals, unseeded samplers and greedy requests; their logprobs
    are the model's (oracle at the engine's depths), and they really sample (not the greedy output)."""
    kw = dict(kv_layout=layout, exit_mode=mode)
    seeded = [(f"s{i}", PROMPTS[i], p) for i, p in enumerate(SAMPLED)]
    noise = [
        (
            f"u{i}",
            PROMPTS[3 + i],
            SamplingParams(max_tokens=7 + i, temperature=1.0, top_p=0.95, ignore_eos=True, exit_threshold=0.5),
        )
        for i in range(2)
    ]
    greedy = mixed_requests(mode)[4:6]
    requests = [seeded[0], noise[0], greedy[0], seeded[1], noise[1], greedy[1], seeded[2]]
    arrivals = {rid: s for (rid, _, _), s in zip(requests, [0, 0, 1, 3, 4, 6, 9])}
    eng = busy_engine(toy_path, async_scheduling=async_scheduling, **kw)
    run = drive(eng, requests, arrivals)
    sampled_differs = 0
    for rid, prompt, params in seeded:
        out = run.final[rid]
        assert_same(out, alone(toy_path, prompt, params, **kw), rid)
        check_against_oracle(oracle, prompt, out, layout, greedy=False)
        g = SamplingParams(
            max_tokens=params.max_tokens,
            temperature=0.0,
            ignore_eos=True,
            exit_threshold=params.exit_threshold,
            min_loops=params.min_loops,
            max_loops=params.max_loops,
        )
        sampled_differs += alone(toy_path, prompt, g, **kw).token_ids != out.token_ids
    for rid, prompt, params in greedy:
        assert_same(run.final[rid], alone(toy_path, prompt, params, **kw), rid)
    assert sampled_differs >= 2, "seeded requests should really sample"
    assert len(decode_depths(run.final[r] for r, _, _ in seeded)) >= 2
