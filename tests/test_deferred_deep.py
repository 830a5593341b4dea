"""Deferred deep batching (`deferred_deep_interval` B, readout loop r; docs/engine.md) against a dense fp32
implementation of the same semantics, written here from the definition:

* the prompt runs all T loops; its last position's loop-T logits give token 0;
* output token k (k >= 1) comes from the input token k-1 at position P+k-1, which runs loops 1..r (writing
  KV planes 1..r there); its loop-r state is retained. When k % B != 0, token k is read out at loop r;
* when k % B == 0 (a boundary), loops r+1..T run over the retained states of positions P+k-B..P+k-1, as one
  causal chunk at their positions, writing planes r+1..T there; token k is read out at loop T of the last.

The reference keeps every (position, loop, layer) K/V and reads them through the dense oracle's layer; an
entry it has not written yet is None, so a computation that reads KV the definition has not produced fails
here. Tokens, logprobs and every KV plane the definition populates must equal the engine's (fp32, 1e-4),
for B = 1, 2, 4, 8 with staggered arrivals, requests that stop mid-interval (max_tokens, a stop token the
host sees), aborts, synchronous and asynchronous scheduling; B = 1 equals full depth; the eager
same-readout control gives the same tokens and depths; no KV block is left allocated.
"""

from __future__ import annotations

import math

import pytest
import torch
from engine_helpers import BATCH_PROMPTS, drive, make_plain_engine

from ouro_backend import SamplingParams
from ouro_backend.config import ConfigError, KVLayout
from ouro_backend.model.oracle import penalize_ref, rms_norm_ref
from ouro_backend.outputs import FinishReason
from ouro_backend.sampling_params import RequestError

R = 2  # the readout loop (the default)
# Seven prompts, and the first again: its full prompt blocks come from the prefix cache.
PROMPTS = [*BATCH_PROMPTS, BATCH_PROMPTS[0]]


def reference(oracle, prompt, max_tokens: int, B: int, r: int = R, stop_token: int | None = None, penalties=None):
    """(tokens, depths, logprobs, kv) of greedy deferred decoding; kv[(pos, loop)] = per layer (k, v) of the
    KV the definition has populated when the request ends. penalties: (repetition, presence, frequency),
    applied to the readout's logits before the argmax (the logprob is the raw distribution's, as vLLM's)."""
    cfg, w = oracle.cfg, oracle.w
    T, L, P = cfg.total_ut_steps, cfg.num_hidden_layers, len(prompt)
    full = [T] * (P + max_tokens)  # the oracle's layer reads loop d's KV of earlier positions: KV planes
    kv: list[list[list]] = [[[None] * L for _ in range(T)] for _ in range(P + max_tokens)]

    def loops(h: torch.Tensor, i: int, ds) -> torch.Tensor:
        for d in ds:
            for layer in range(L):
                h = oracle._layer(h, i, d, layer, kv, P, full, KVLayout.LAST_EXITED)
            h = rms_norm_ref(h, w["model.norm.weight"], cfg.rms_norm_eps)
        return h

    def read(h: torch.Tensor) -> tuple[int, float]:
        logits = (h @ w["lm_head.weight"].t()).float()[0]
        chosen = logits if penalties is None else penalize_ref(logits, prompt, tokens, penalties)
        tok = int(chosen.argmax())
        return tok, float(torch.log_softmax(logits, -1)[tok])

    embed = w["model.embed_tokens.weight"]
    tokens: list[int] = []
    h = None
    for i, t in enumerate(prompt):
        h = loops(embed[t][None], i, range(T))
    tok, lp = read(h)
    tokens.append(tok)
    depths, logprobs = [T], [lp]
    retained: dict[int, torch.Tensor] = {}
    for k in range(1, max_tokens):
        if stop_token is not None and tokens[-1] == stop_token:
            break
        i = P + k - 1
        retained[i] = loops(embed[tokens[-1]][None], i, range(r))
        if k % B:
            tok, lp = read(retained[i])
            depth = r
        else:
            for q in range(i - B + 1, i + 1):
                deep = loops(retained.pop(q), q, range(r, T))
            tok, lp = read(deep)
            depth = T
        tokens.append(tok)
        depths.append(depth)
        logprobs.append(lp)
    populated = {(j, d): kv[j][d] for j in range(len(kv)) for d in range(T) if all(x is not None for x in kv[j][d])}
    return tokens, depths, logprobs, populated


def engine(toy_path, B, *, eager=False, **kw):
    kw.setdefault("max_num_batched_tokens", 64)
    kw.setdefault("num_blocks", 512)
    return make_plain_engine(toy_path, exit_threshold=None, deferred_deep_interval=B, deferred_deep_eager=eager, **kw)


def record_kv_at_finish(eng) -> dict:
    """request id -> {(pos, plane): [(k, v) per layer]} of every position it had written, taken when the host
    ends it (its blocks are freed then, and reused by later requests)."""
    got: dict = {}
    finish = eng.scheduler.finish
    kv, bs = eng.kv, eng.kv.block_size

    def recording(seq, reason):
        n = len(seq.prompt_ids) + len(seq.output_ids) - 1  # positions whose input has run
        if seq.block_tables:
            got[seq.request_id] = {
                (p, d): [
                    (kv.kv[layer, 0, t[p // bs], p % bs].clone(), kv.kv[layer, 1, t[p // bs], p % bs].clone())
                    for layer in range(kv.kv.shape[0])
                ]
                for d, t in enumerate(seq.block_tables)
                for p in range(n)
                if p // bs < len(t)
            }
        return finish(seq, reason)

    eng.scheduler.finish = recording
    return got


def check_against_reference(oracle, run, kv_seen, requests, B, stop_tokens=None, kv_atol=1e-4):
    stop_tokens = stop_tokens or {}
    for rid, prompt, params in requests:
        out = run.final[rid]
        if out.finish_reason == FinishReason.ABORT:
            continue
        tokens, depths, logprobs, ref_kv = reference(
            oracle, prompt, params.max_tokens, B, stop_token=stop_tokens.get(rid)
        )
        assert out.token_ids == tokens, (rid, B)
        assert out.exit_depths == depths, (rid, B)
        assert max(abs(a - b) for a, b in zip(out.logprobs, logprobs)) < 1e-4, (rid, B)
        seen = kv_seen[rid]
        for key, layers in ref_kv.items():
            assert key in seen, (rid, key)
            for (k, v), (gk, gv) in zip(layers, seen[key]):
                gk, gv = gk.cpu(), gv.cpu()
                assert torch.allclose(gk, k, atol=kv_atol, rtol=0) and torch.allclose(gv, v, atol=kv_atol, rtol=0), (
                    rid,
                    B,
                    key,
                )


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("B", [1, 2, 4, 8])
def test_deferred_deep_equals_the_dense_definition(toy_path, oracle, B, async_scheduling):
    eng = engine(toy_path, B, async_scheduling=async_scheduling)
    kv_seen = record_kv_at_finish(eng)
    # Lengths that end mid-interval and on a boundary; staggered arrivals misalign the requests' boundaries.
    lengths = [11, 8, 5, 13, 1, 9, 6, 7]
    requests = [
        (f"r{i}", p, SamplingParams(max_tokens=lengths[i], temperature=0.0, ignore_eos=True))
        for i, p in enumerate(PROMPTS)
    ]
    run = drive(eng, requests, arrivals={"r1": 2, "r2": 3, "r3": 7, "r5": 5, "r7": 9})
    check_against_reference(oracle, run, kv_seen, requests, B)
    assert run.final["r7"].num_cached_tokens > 0  # r0's prompt blocks, from the prefix cache
    stats = eng.runner.stats
    if B > 1:
        assert stats.deep_rounds > 0 and stats.deep_rows >= stats.deep_rounds * B


def test_interval_one_is_full_depth(toy_path):
    params = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)
    requests = [(f"r{i}", p, params) for i, p in enumerate(PROMPTS[:4])]
    full = drive(make_plain_engine(toy_path, exit_threshold=1.0), requests)
    one = drive(engine(toy_path, 1), requests)
    for rid, *_ in requests:
        assert one.final[rid].token_ids == full.final[rid].token_ids
        assert one.final[rid].exit_depths == full.final[rid].exit_depths == [4] * 9


@pytest.mark.parametrize("B", [2, 4])
def test_eager_same_readout_gives_the_deferred_tokens(toy_path, oracle, B):
    """Also with penalties (their counts include the boundary tokens the deep chunks read out), which equal
    the definition's."""
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    penalized = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, repetition_penalty=1.5)
    requests = [(f"r{i}", p, penalized if i % 2 else params) for i, p in enumerate(PROMPTS[:5])]
    arrivals = {"r1": 1, "r3": 4}
    deferred = drive(engine(toy_path, B), requests, arrivals)
    eager_eng = engine(toy_path, B, eager=True)
    eager = drive(eager_eng, requests, arrivals)
    for rid, *_ in requests:
        a, b = deferred.final[rid], eager.final[rid]
        assert a.token_ids == b.token_ids and a.exit_depths == b.exit_depths, rid
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    assert eager_eng.runner.stats.deep_rounds == 0  # eager runs the deep loops in the decode rows
    for rid, prompt, p in requests:
        tokens, depths, _, _ = reference(oracle, prompt, 10, B, penalties=(p.repetition_penalty, 0.0, 0.0))
        assert deferred.final[rid].token_ids == tokens and deferred.final[rid].exit_depths == depths, rid


def test_a_host_stop_mid_interval_drops_the_deep_tail(toy_path, oracle):
    """A stop token the host sees ends the request while the device runs on (asynchronous scheduling): a
    row that parked after the stop is dropped, and its blocks are freed."""
    B = 4
    prompt = PROMPTS[0]
    tokens = reference(oracle, prompt, 12, B)[0]
    # A token that first appears mid-interval (not at a boundary index).
    m = next(k for k in range(2, 12) if k % B and tokens[k] not in tokens[:k])
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[tokens[m]])
    others = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    requests = [("stop", prompt, params), ("other", PROMPTS[1], others)]
    eng = engine(toy_path, B, async_scheduling=True)
    kv_seen = record_kv_at_finish(eng)
    run = drive(eng, requests)
    assert run.final["stop"].token_ids == tokens[: m + 1]
    assert run.final["stop"].finish_reason == FinishReason.STOP
    check_against_reference(oracle, run, kv_seen, requests, B, stop_tokens={"stop": tokens[m]})


def test_a_stop_string_mid_interval_ends_it(toy_path, oracle):
    """A stop string the host matches mid-interval: the output is the definition's up to the match, the
    request ends with "stop", and drive() finds every KV block free."""
    B = 4
    prompt = PROMPTS[0]
    tokens = reference(oracle, prompt, 12, B)[0]
    eng = engine(toy_path, B, async_scheduling=True)
    m = next(k for k in range(2, 12) if k % B and eng.tokenizer.decode([tokens[k]]).strip())
    stop = eng.tokenizer.decode([tokens[m]]).strip()
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop])
    out = drive(eng, [("s", prompt, params)]).final["s"]
    assert out.finish_reason == FinishReason.STOP and stop not in out.text
    assert 1 <= len(out.token_ids) <= m + 1 and out.token_ids == tokens[: len(out.token_ids)]


@pytest.mark.parametrize("when", [3, 6, 9])
def test_aborts_leave_the_others_exact(toy_path, oracle, when):
    """Aborted at different steps: waiting for a deep chunk, inside one, or between boundaries."""
    B = 4
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    requests = [(f"r{i}", p, params) for i, p in enumerate(PROMPTS[:4])]
    eng = engine(toy_path, B, async_scheduling=True)
    kv_seen = record_kv_at_finish(eng)

    def hook(eng, step, run):
        if step == when:
            eng.abort_request("r1")

    run = drive(eng, requests, hook=hook)
    assert run.final["r1"].finish_reason == FinishReason.ABORT
    check_against_reference(oracle, run, kv_seen, requests, B)


def test_seeded_sampling_is_request_local(toy_path):
    """The same seeded tokens alone, in a batch, and under the eager control (each token's draw is its
    row's counter, whichever loop reads it out)."""
    B = 4
    params = [SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=100 + i) for i in range(4)]
    requests = [(f"r{i}", p, params[i]) for i, p in enumerate(PROMPTS[:4])]
    batch = drive(engine(toy_path, B, async_scheduling=True), requests, arrivals={"r2": 3})
    eager = drive(engine(toy_path, B, eager=True), requests)
    for rid, prompt, p in requests:
        one = drive(engine(toy_path, B), [(rid, prompt, p)]).final[rid]
        assert batch.final[rid].token_ids == one.token_ids == eager.final[rid].token_ids, rid
        assert not math.isnan(sum(one.logprobs))


def test_options_it_cannot_combine_with_are_refused(toy_path):
    for kw, what in [
        (dict(kv_layout="shared"), "kv_layout=last_exited"),
        (dict(spec_tokens=2, exit_threshold=1.0), "speculation"),
        (dict(exit_threshold=0.5), "gate exits"),
        (dict(exit_mode="trace"), "gate exits"),
        (dict(preemption_mode="swap"), "preempted"),
        (dict(deferred_readout_loop=4), "deferred_readout_loop (4) must be in [1, 3]"),
        (dict(deferred_deep_interval=65), "deferred_deep_interval must be an integer in [0, 64]"),
        (dict(deferred_deep_interval=16, max_num_batched_tokens=8), "cannot exceed max_num_batched_tokens"),
    ]:
        kw.setdefault("deferred_deep_interval", 4)
        kw.setdefault("exit_threshold", None)
        with pytest.raises(ConfigError, match=what.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            make_plain_engine(toy_path, **kw)
    with pytest.raises(ConfigError, match="deferred_deep_eager needs deferred_deep_interval > 0"):
        make_plain_engine(toy_path, deferred_deep_eager=True)
    eng = engine(toy_path, 4)
    for bad in (dict(exit_threshold=0.5), dict(max_loops=2), dict(min_loops=2), dict(exit_trace=[1, 2])):
        with pytest.raises(RequestError, match="fixes every token's depth"):
            eng.add_request("x", PROMPTS[0], SamplingParams(max_tokens=4, **bad))
    # The engine still serves.
    run = drive(eng, [("ok", PROMPTS[0], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))])
    assert len(run.final["ok"].token_ids) == 5


def test_ouro_engine_parameters_turn_it_on():
    """config.pbtxt `parameters` / $OURO_ENGINE_ARGS of `ouro_engine` (the same EngineConfig fields)."""
    from ouro_backend.config import EngineConfig
    from ouro_backend.serving.options import engine_options

    cfg = {"parameters": {"deferred_deep_interval": {"string_value": "8"}}}
    opts, _ = engine_options(cfg, None, environ={"OURO_ENGINE_ARGS": "deferred_deep_eager=true"})
    config = EngineConfig.from_strings(opts)
    assert (config.deferred_deep_interval, config.deferred_readout_loop, config.deferred_deep_eager) == (8, 2, True)
    with pytest.raises(ConfigError, match="deferred_deep_interval"):
        EngineConfig.from_strings({"deferred_deep_interval": "-1"})


def test_deep_chunks_get_budget_when_every_slot_decodes(oracle, toy_path):
    """max_num_batched_tokens = max_num_seqs and every slot busy: a parked row takes no decode row, so the
    deep chunks start once enough rows have parked (no request waits forever)."""
    B = 4
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    requests = [(f"r{i}", p, params) for i, p in enumerate(PROMPTS[:4])]
    eng = engine(toy_path, B, max_num_seqs=4, max_num_batched_tokens=4)
    kv_seen = record_kv_at_finish(eng)
    run = drive(eng, requests, arrivals={"r1": 1, "r2": 2, "r3": 3})
    check_against_reference(oracle, run, kv_seen, requests, B)


@pytest.mark.parametrize("eager", [False, True])
def test_a_small_cache_admits_fewer_and_preempts_nobody(oracle, toy_path, eager):
    """A cache too small for every request at once: both modes reserve each request's whole KV at admission,
    so later requests wait instead of anyone being preempted (a recompute would rebuild loop-r positions
    without their true deep KV), and the tokens are the definition's."""
    B = 4
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    requests = [(f"r{i}", p, params) for i, p in enumerate(PROMPTS[:6])]
    # 4 planes x ceil((prompt + 16) / 4) blocks: about 32-40 blocks a request; 100 hold two or three.
    eng = engine(toy_path, B, eager=eager, num_blocks=100, kv_watermark=0.0)
    run = drive(eng, requests)
    assert eng.stats()["num_preemptions"] == 0 and run.max_running < len(requests)
    for rid, prompt, p in requests:
        tokens, depths, _, _ = reference(oracle, prompt, p.max_tokens, B)
        assert run.final[rid].token_ids == tokens and run.final[rid].exit_depths == depths, rid
