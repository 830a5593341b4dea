"""Repetition / presence / frequency penalties and returned logprobs, fp32 on CPU: greedy tokens equal the
dense oracle with the penalties applied (`oracle.penalize_ref`), alone and batched with requests without
them, which stay exactly what they are alone; seeded sampled tokens equal a race computed from the logits
the engine recorded, alone, batched, over multi-round async launches, preempted (recompute and swap) and
with self-speculation on; the logprobs handed out are Sequence.logprobs (the model's, before penalties)."""

from __future__ import annotations

import math

import pytest
import torch
from engine_helpers import ORACLE_PROMPTS as PROMPTS
from engine_helpers import alone, assert_same, drive, run_all
from engine_helpers import make_plain_engine as make_plain
from engine_helpers import make_recording_engine as make_engine

from ouro_backend import SamplingParams
from ouro_backend.model.oracle import penalize_ref
from ouro_backend.model.sampler import apply_penalties, filter_top_k_top_p, uniform_noise, vocab_hashes

# (repetition, presence, frequency), each changing the toy model's greedy output of PROMPTS. The toy model
# (random weights) does not repeat itself, so the sets pull repeats in (repetition < 1, presence < 0) and
# push them back out (presence, frequency > 0).
PENALTIES = [(0.5, 1.0, 0.0), (0.6, 0.0, 2.0), (1.0, -2.0, 0.0), (0.7, -1.0, 0.5)]
NEUTRAL = (1.0, 0.0, 0.0)
N = 8


def penalized(pen, **kw) -> SamplingParams:
    kw = dict(dict(max_tokens=N, temperature=0.0, ignore_eos=True, exit_threshold=1.0), **kw)
    return SamplingParams(repetition_penalty=pen[0], presence_penalty=pen[1], frequency_penalty=pen[2], **kw)


def test_apply_penalties_equals_the_token_by_token_reference():
    g = torch.Generator().manual_seed(0)
    V, R = 50, 4
    logits = torch.randn(R, V, generator=g) * 3
    prompts = [[1, 2, 3, 3], [], [7], [4, 5]]
    outputs = [[2, 9, 9, 9], [0, 0, 1], [], [4, 4, 6]]
    counts = torch.zeros(R, V, dtype=torch.int32)
    prompt = torch.zeros(R, V, dtype=torch.bool)
    for r in range(R):
        prompt[r, prompts[r]] = True
        for t in outputs[r]:
            counts[r, t] += 1
    pens = [(1.3, 0.5, 0.25), (0.7, -2.0, 2.0), (2.0, 1.0, 1.0), (1.0, 0.0, 0.0)]
    rep, pres, freq = (torch.tensor([p[i] for p in pens], dtype=torch.float32) for i in range(3))
    got = apply_penalties(logits, counts, prompt, rep, pres, freq)
    for r in range(R):
        assert torch.equal(got[r], penalize_ref(logits[r], prompts[r], outputs[r], pens[r])), r
    assert torch.equal(got[3], logits[3])  # neutral values: bit for bit unchanged


def test_greedy_penalties_match_oracle_and_leave_batch_mates_alone(toy_path, oracle):
    """One batch: each prompt with each penalty set, plus each prompt without: penalized tokens equal the
    oracle's, the others equal their run alone (PENALIZE mode leaves their logits exactly as they are)."""
    plain = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True, exit_threshold=1.0, logprobs=True)
    alone_outs = run_all(make_engine(toy_path), PROMPTS, plain)
    reqs = [(p, penalized(pen)) for pen in PENALTIES for p in PROMPTS] + [(p, plain) for p in PROMPTS]
    outs = run_all(make_engine(toy_path, max_num_seqs=16), [r[0] for r in reqs], [r[1] for r in reqs])
    changed = set()
    for (prompt, params), out in zip(reqs, outs):
        if params.penalized:
            pen = (params.repetition_penalty, params.presence_penalty, params.frequency_penalty)
            assert out.token_ids == oracle.generate(prompt, N, penalties=pen)[0], pen
            if out.token_ids != alone_outs[PROMPTS.index(prompt)].token_ids:
                changed.add(pen)
    for out, ref in zip(outs[-len(PROMPTS) :], alone_outs):
        assert out.token_ids == ref.token_ids  # (logprobs: equal up to the batch's fp32 reduction order)
        assert max(abs(a - b) for a, b in zip(out.logprobs, ref.logprobs)) < 1e-5
    assert changed == set(PENALTIES), "a penalty set changes nothing: the test proves little for it"


def _race_reference(prompt, out, recorded, params) -> list[int]:
    """The tokens seeded sampling draws from the engine's own recorded logits with the penalties applied
    by the reference: token k races with the noise of (seed, k)."""
    pen = (params.repetition_penalty, params.presence_penalty, params.frequency_penalty)
    V = recorded[0].shape[-1]
    toks = []
    for k, logits in enumerate(recorded):
        x = penalize_ref(logits, prompt, out.token_ids[:k], pen)[None] / params.temperature
        x = filter_top_k_top_p(x, torch.tensor([params.top_k]), torch.tensor([params.top_p]))
        u = uniform_noise(torch.tensor([params.seed]), torch.tensor([k]), vocab_hashes(V, torch.device("cpu")))
        toks.append(int((x - torch.log(-torch.log(u))).argmax()))
    return toks


def test_seeded_penalized_sampling_equals_reference_alone_and_batched(toy_path):
    sampling = [
        dict(temperature=0.5, seed=11 + i, top_k=40 if i % 2 else 0, top_p=0.9 if i == 3 else 1.0) for i in range(4)
    ]
    params = [penalized(pen, **kw) for pen, kw in zip(PENALTIES, sampling)]
    eng = make_engine(toy_path)
    first = run_all(eng, [PROMPTS[0]] * len(params), params)
    unpenalized = run_all(
        make_engine(toy_path), [PROMPTS[0]] * len(params), [penalized(NEUTRAL, **kw) for kw in sampling]
    )
    for i, (p, out) in enumerate(zip(params, first)):
        assert out.token_ids == _race_reference(PROMPTS[0], out, eng.recorded[str(i)], p), i
        assert out.token_ids != unpenalized[i].token_ids, "the penalties change nothing: the test proves little"
    # The same requests among unpenalized sampled and greedy ones, arriving later
    busy = [SamplingParams(max_tokens=n, temperature=0.8, ignore_eos=True) for n in (3, 12)]
    eng = make_engine(toy_path)
    outs = run_all(eng, [PROMPTS[1], PROMPTS[2]] + [PROMPTS[0]] * len(params), busy + params)
    assert [o.token_ids for o in outs[2:]] == [o.token_ids for o in first]


def test_penalties_over_multi_round_async_launches_and_preemption(toy_path):
    """Counts and tails kept on the device across several rounds per launch and async read-back; rebuilt on a
    recompute preemption, carried by a swapped-out row: every request equals its run alone."""
    prompts = [[10 + i, 200 + 7 * i, 3 * i + 1, 900 - i] for i in range(8)]
    params = [
        penalized(
            PENALTIES[i % 4] if i != 4 else NEUTRAL,
            max_tokens=28,
            temperature=0.8 if i % 2 else 0.0,
            seed=100 + i,
            bad_words=["ear", "O W"] if i in (1, 4, 5) else [],  # request 4: bad words alone
        )
        if i % 3
        else SamplingParams(max_tokens=28, ignore_eos=True, exit_threshold=1.0, temperature=0.0)
        for i in range(8)
    ]
    for mode in ("recompute", "swap"):
        eng = make_plain(toy_path, num_blocks=128, async_scheduling=True, preemption_mode=mode)
        run = drive(eng, [(str(i), p, params[i]) for i, p in enumerate(prompts)])
        st = eng.stats()
        assert st["num_preemptions"] > 0 and eng.runner.stats.rounds > eng.runner.stats.launches
        for i, p in enumerate(prompts):
            assert_same(run.final[str(i)], alone(toy_path, p, params[i]), f"{mode}: request {i}")


def test_penalized_requests_turn_speculation_off_and_stay_exact(toy_path, oracle):
    """Self-speculation and penalties: a batch with a penalized request decodes plainly (exact); without
    one the engine speculates again."""
    from ouro_backend import LLMEngine
    from ouro_backend.config import EngineConfig

    cfg = dict(model=toy_path, device="cpu", dtype="float32", block_size=4, num_blocks=512, max_num_seqs=8)
    eng = LLMEngine(EngineConfig(spec_tokens=3, spec_auto=False, **cfg))
    greedy = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
    outs = run_all(eng, PROMPTS[:2], [penalized(PENALTIES[0], exit_threshold=None), greedy])
    assert outs[0].token_ids == oracle.generate(PROMPTS[0], N, penalties=PENALTIES[0])[0]
    assert outs[1].token_ids == oracle.generate(PROMPTS[1], N)[0]
    assert eng.runner.stats.spec_steps == 0
    run_all(eng, PROMPTS[:1], greedy)
    assert eng.runner.stats.spec_steps > 0


@pytest.mark.parametrize("pen", [None, PENALTIES[3]])
def test_logprobs_handed_out_are_sequence_logprobs(toy_path, pen):
    """With logprobs on, the deltas' new_logprobs add up to the final logprobs (the model's, before the
    penalties: log_softmax of the recorded logits); off, the deltas carry none."""
    kw = dict(max_tokens=N, temperature=0.7, seed=5, ignore_eos=True)
    for want in (True, False):
        params = penalized(pen, logprobs=want, **kw) if pen else SamplingParams(logprobs=want, **kw)
        eng = make_engine(toy_path)
        eng.add_request("0", PROMPTS[0], params)
        deltas, final = [], None
        while eng.has_unfinished_requests():
            for o in eng.step():
                deltas.append(o.new_logprobs)
                assert len(o.new_logprobs) == (len(o.new_token_ids) if want else 0)
                final = o if o.finished else final
        assert final is not None and len(final.logprobs) == N
        if want:
            assert [x for d in deltas for x in d] == final.logprobs
        for tok, lp, logits in zip(final.token_ids, final.logprobs, eng.recorded["0"]):
            assert math.isclose(lp, float(torch.log_softmax(logits, -1)[tok]), abs_tol=1e-5)


def test_bad_words_match_oracle_batched_with_penalties_and_plain_requests(toy_path, oracle):
    """Words from the toy's own greedy output: a one-token word ("ear") is never generated, and a two-token
    one (" oad", " O W") only loses its last token after its first; with penalties too. Batch mates without
    them are unchanged."""
    from ouro_backend.sampling_params import bad_words_token_ids

    plain = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True, exit_threshold=1.0)
    eng = make_engine(toy_path, max_num_seqs=16)
    base = run_all(eng, PROMPTS, plain)
    cases = [(0, ["ear"], NEUTRAL), (1, ["oad"], NEUTRAL), (2, ["O W"], NEUTRAL), (2, ["O W", "sun"], PENALTIES[3])]
    reqs = [(PROMPTS[i], penalized(pen, bad_words=words)) for i, words, pen in cases] + [(p, plain) for p in PROMPTS]
    outs = run_all(eng, [r[0] for r in reqs], [r[1] for r in reqs])
    for (i, words, pen), out in zip(cases, outs):
        ids = bad_words_token_ids(eng.tokenizer, words)
        want = oracle.generate(PROMPTS[i], N, penalties=pen, bad_words=ids)[0]
        assert out.token_ids == want != base[i].token_ids, words
        for w in ids:  # never the whole word
            assert not any(out.token_ids[k : k + len(w)] == w for k in range(N)), (words, w)
    for w in bad_words_token_ids(eng.tokenizer, ["oad"]) + bad_words_token_ids(eng.tokenizer, ["O W"]):
        if w[0] in base[1].token_ids + base[2].token_ids:  # the words' first tokens are still generated
            assert w[0] in outs[1].token_ids + outs[2].token_ids
    assert [o.token_ids for o in outs[len(cases) :]] == [o.token_ids for o in base]


def test_bad_words_are_refused_beyond_the_limits_by_the_engine(toy_path):
    from ouro_backend.engine.llm_engine import RequestError
    from ouro_backend.sampling_params import MAX_BAD_WORDS

    eng = make_plain(toy_path)
    with pytest.raises(RequestError, match="bad_words come to .* token sequences"):
        eng.add_request("x", [1, 2], SamplingParams(bad_words=[f"w{i}" for i in range(MAX_BAD_WORDS + 1)]))
    assert not eng.has_unfinished_requests()
