"""Engine helpers shared by the engine test modules (tests/ is on sys.path, so ``from engine_helpers import ...``).

Two engine factories on the toy checkpoint (fp32, CPU, block size 4), which differ:
* ``make_recording_engine`` (from test_engine_oracle.py): records each request's logits per emitted token in
  ``eng.recorded`` (request id -> [logits]); 512 blocks, 8 rows, the config's own exit threshold and seed.
* ``make_plain_engine`` (from test_exact_exits.py): records nothing; 256 blocks, 8 rows, 64 batched tokens,
  ``exit_threshold=ENGINE_THRESHOLD``, ``seed=0``; kv_layout / exit_mode / async_scheduling keyword-only.
Each comes with its own prompt set: ORACLE_PROMPTS (3 prompts) and BATCH_PROMPTS (7 prompts).
"""

from __future__ import annotations

import numpy as np
import torch

from ouro_backend import LLMEngine, SamplingParams
from ouro_backend.config import EngineConfig
from ouro_backend.engine.model_runner import Emitted

# ------------------------------------------------- from test_engine_oracle.py: logit-recording engine
ORACLE_PROMPTS = [
    [5, 17, 300, 42, 9, 77, 120, 8, 64, 3, 250, 11, 90],  # 13 tokens
    [400, 23, 7],
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20],
]


def make_recording_engine(toy_path, **kw) -> LLMEngine:
    kw.setdefault("num_blocks", 512)
    kw.setdefault("max_num_seqs", 8)
    kw.setdefault("device", "cpu")
    kw.setdefault("dtype", "float32")
    eng = LLMEngine(EngineConfig(model=toy_path, block_size=4, **kw))
    eng.runner.record_logits = True
    eng.recorded = {}
    collect = eng.runner.collect

    def recording_collect(rnd):
        emitted = collect(rnd)
        for e in emitted:
            if isinstance(e, Emitted) and not e.seq.finished:  # tokens of a request that already stopped are dropped
                eng.recorded.setdefault(e.seq.request_id, []).append(e.logits)
        return emitted

    eng.runner.collect = recording_collect
    return eng


def run_all(eng, prompts, params):
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, params if isinstance(params, SamplingParams) else params[i])
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
    assert eng.kv.pool.num_available == eng.kv.num_blocks, "KV blocks leaked"
    return [outs[str(i)] for i in range(len(prompts))]


def ouro_exit(threshold, min_loops=1, max_loops=4):
    """The ouro exit rule computed independently from the oracle's gate values (fp32)."""

    def fn(gates):
        remaining = np.float32(1.0)
        for r, lam in enumerate(gates, start=1):
            remaining = np.float32(remaining * (np.float32(1.0) - np.float32(lam)))
            if r >= max_loops or (threshold < 1 and r >= min_loops and np.float32(1.0) - remaining >= threshold):
                return r
        return len(gates)

    return fn


def check_exits_against_oracle(eng, oracle, prompts, threshold, layout, max_tokens=8) -> set[int]:
    """Batch `prompts` with the gate at `threshold`: tokens and exit depths equal the oracle's, and every
    step's logits equal a fresh oracle pass with the engine's own depths (fp32, 1e-4). Returns the depths."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, exit_threshold=threshold)
    outs = run_all(eng, prompts, params)
    all_depths = set()
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        tokens, depths = oracle.generate(prompt, max_tokens, exit_fn=ouro_exit(threshold), layout=layout)
        assert (out.token_ids, out.exit_depths) == (tokens, depths), (layout, threshold, i)
        all_depths |= set(depths[1:])
        seq = prompt + out.token_ids
        loops = [4] * len(prompt) + out.exit_depths[1:] + [4]
        ref = oracle.forward(seq[:-1], len(prompt), loops[: len(seq) - 1], layout)
        for k, got in enumerate(eng.recorded[str(i)]):
            assert torch.allclose(got, ref.logits[len(prompt) - 1 + k], atol=1e-4, rtol=0)
    return all_depths


# ----------------------------------------------------- from test_exact_exits.py: plain engine, drive
ENGINE_THRESHOLD = 0.7  # the engine's exit_threshold, used by requests that leave theirs as None
BATCH_PROMPTS = [
    [5, 17, 300, 42, 9, 77, 120, 8, 64, 3, 250, 11, 90],
    [400, 23, 7],
    [1, 2, 3, 4, 5, 6, 7, 8],
    [611, 12, 903, 44, 5],
    [77, 77, 78, 79, 1000, 2],
    [250, 251, 3, 9, 10, 500, 600, 700, 800, 12],
    [33, 900, 4],
]


def make_plain_engine(
    toy_path, *, kv_layout="last_exited", exit_mode="ouro", async_scheduling=False, **kw
) -> LLMEngine:
    """A small fp32 CPU engine on the toy checkpoint. Defaults: one prompt in one chunk, room for 8 rows."""
    cfg = dict(
        model=toy_path,
        device="cpu",
        dtype="float32",
        block_size=4,
        num_blocks=256,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        exit_threshold=ENGINE_THRESHOLD,
        seed=0,
    )
    cfg.update(kw)
    return LLMEngine(EngineConfig(kv_layout=kv_layout, exit_mode=exit_mode, async_scheduling=async_scheduling, **cfg))


class Run:
    """Everything a driven engine handed back."""

    def __init__(self):
        self.streams: dict[str, list] = {}  # request id -> its RequestOutputs in order
        self.final: dict[str, object] = {}  # request id -> its finished RequestOutput
        self.final_step: dict[str, int] = {}
        self.max_running = 0
        self.steps = 0
        self.midstream_at_arrival: dict[str, int] = {}  # requests already streaming when this one arrived

    def streamed(self, rid) -> list[int]:
        return [t for o in self.streams.get(rid, []) for t in o.new_token_ids]


def drive(eng, requests, arrivals=None, hook=None, max_steps=3000) -> Run:
    """Step `eng` until every request has finished and check the stream invariants.

    requests: [(rid, prompt, params)]; arrivals: rid -> the step before which it is added (default 0).
    hook(eng, step, run) runs before every step, after that step's arrivals were added (aborts go here).
    Checks: exactly one finished output per request and nothing after it; the deltas add up to the final
    output; no KV block is left allocated.
    """
    arrivals = arrivals or {}
    pending = sorted(requests, key=lambda r: arrivals.get(r[0], 0))
    run = Run()
    step = 0
    while pending or eng.has_unfinished_requests():
        while pending and arrivals.get(pending[0][0], 0) <= step:
            rid, prompt, params = pending.pop(0)
            run.midstream_at_arrival[rid] = sum(
                1 for r, outs in run.streams.items() if r not in run.final and any(o.new_token_ids for o in outs)
            )
            eng.add_request(rid, prompt, params)
        if hook is not None:
            hook(eng, step, run)
        for o in eng.step():
            assert o.request_id not in run.final, f"output for {o.request_id} after it finished"
            run.streams.setdefault(o.request_id, []).append(o)
            if o.finished:
                run.final[o.request_id] = o
                run.final_step[o.request_id] = step
        run.max_running = max(run.max_running, eng.stats()["num_running"])
        step += 1
        assert step < max_steps, "engine does not finish"
    run.steps = step
    assert sorted(run.final) == sorted(r[0] for r in requests)
    for rid, out in run.final.items():
        assert run.streamed(rid) == out.token_ids, rid
        assert [d for o in run.streams[rid] for d in o.new_exit_depths] == out.exit_depths, rid
        assert len(out.logprobs) == len(out.token_ids) == len(out.exit_depths)
    assert eng.kv.pool.num_available == eng.kv.num_blocks, "KV blocks leaked"
    stats = eng.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    return run


_ALONE: dict = {}


def alone(toy_path, prompt, params, **engine_kw):
    """The request's output alone in a fresh synchronous engine (cached: many tests share references)."""
    key = (tuple(prompt), repr(params), repr(sorted(engine_kw.items())))
    if key not in _ALONE:
        eng = make_plain_engine(toy_path, **engine_kw)
        _ALONE[key] = drive(eng, [("alone", prompt, params)]).final["alone"]
    return _ALONE[key]


def assert_same(got, ref, what=""):
    """Same tokens, depths and finish reason; logprobs equal up to fp32 reduction order."""
    assert got.token_ids == ref.token_ids, what
    assert got.exit_depths == ref.exit_depths, what
    assert got.finish_reason == ref.finish_reason, what
    assert np.allclose(got.logprobs, ref.logprobs, atol=1e-5, rtol=0), what
