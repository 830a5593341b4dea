"""Sampling: seeds independent of batch mates, top-k/top-p, stop conditions, logprobs."""

import math

import torch
from engine_helpers import ORACLE_PROMPTS as PROMPTS
from engine_helpers import make_recording_engine as make_engine
from engine_helpers import run_all

from ouro_backend import SamplingParams
from ouro_backend.model.sampler import filter_top_k_top_p


def test_seed_reproducible_alone_and_in_busy_batch(toy_path):
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True, exit_threshold=0.5)
    alone = run_all(make_engine(toy_path), [PROMPTS[0]], params)[0]
    busy_params = [SamplingParams(max_tokens=n, temperature=0.8, top_p=0.9, ignore_eos=True) for n in (5, 30, 9)]
    eng = make_engine(toy_path)
    outs = run_all(eng, [PROMPTS[1], PROMPTS[2], PROMPTS[0], PROMPTS[0]], busy_params + [params])
    assert outs[-1].token_ids == alone.token_ids
    assert outs[-1].exit_depths == alone.exit_depths
    other = run_all(
        make_engine(toy_path),
        [PROMPTS[0]],
        SamplingParams(max_tokens=12, temperature=1.0, seed=99, ignore_eos=True, exit_threshold=0.5),
    )[0]
    assert other.token_ids != alone.token_ids


def test_top_k_1_equals_greedy(toy_path):
    greedy = run_all(make_engine(toy_path), PROMPTS, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    topk = run_all(
        make_engine(toy_path), PROMPTS, SamplingParams(max_tokens=10, temperature=1.3, top_k=1, seed=5, ignore_eos=True)
    )
    assert [o.token_ids for o in greedy] == [o.token_ids for o in topk]


def test_top_k_top_p_filters():
    """Per-row values in one call: top-k, top-p, both, neither."""
    logits = torch.log(torch.tensor([[0.05, 0.5, 0.15, 0.3]] * 5))
    kept = ~torch.isinf(
        filter_top_k_top_p(logits, torch.tensor([2, 0, 0, 3, 0]), torch.tensor([1.0, 0.7, 0.5, 0.6, 1.0]))
    )
    assert kept.tolist() == [
        [False, True, False, True],
        [False, True, False, True],  # 0.5 < 0.7 so the second token is needed
        [False, True, False, False],
        [False, True, False, True],  # top-3, then 0.5 < 0.6 needs a second
        [True, True, True, True],
    ]


def test_logprobs_are_model_logprobs(toy_path, oracle):
    eng = make_engine(toy_path)
    out = run_all(eng, [PROMPTS[0]], SamplingParams(max_tokens=3, temperature=0.7, seed=3, ignore_eos=True))[0]
    for tok, lp, logits in zip(out.token_ids, out.logprobs, eng.recorded["0"]):
        assert math.isclose(lp, float(torch.log_softmax(logits, -1)[tok]), abs_tol=1e-5)
        assert lp <= 0


def test_stop_token_eos_min_tokens(toy_path):
    eng = make_engine(toy_path)
    ref = run_all(eng, [PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    target = ref.token_ids[5]
    first = ref.token_ids.index(target)
    out = run_all(
        make_engine(toy_path), [PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[target])
    )[0]
    assert out.finish_reason == "stop" and out.token_ids == ref.token_ids[: first + 1]
    out = run_all(
        make_engine(toy_path),
        [PROMPTS[0]],
        SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[target], min_tokens=first + 2),
    )[0]
    assert len(out.token_ids) > first + 1
    # The same token as EOS: stops unless ignore_eos.
    eng = make_engine(toy_path, eos_token_ids=[target])
    assert run_all(eng, [PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0.0))[0].finish_reason == "stop"
    eng = make_engine(toy_path, eos_token_ids=[target])
    out = run_all(eng, [PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 12


def test_stop_string_never_reaches_caller(toy_path):
    eng = make_engine(toy_path)
    prompt = "The quick brown fox"
    ref = run_all(eng, [prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
    text = eng.tokenizer.decode(ref.token_ids)
    visible = text.replace("\ufffd", "")
    stop = visible[len(visible) // 2 : len(visible) // 2 + 2]
    assert stop and stop in text
    eng = make_engine(toy_path)
    eng.want_text = True
    eng.add_request("s", prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop]))
    deltas, final = [], None
    while eng.has_unfinished_requests():
        for o in eng.step():
            deltas.append(o.new_text)
            final = o
    cut = text.index(stop)
    assert final.finish_reason == "stop"
    assert final.text == text[:cut]
    assert "".join(deltas) == text[:cut]  # streamed deltas never showed any of the stop string


def test_stop_string_respects_min_tokens(toy_path):
    """Before min_tokens the stop string is not searched; held-back text stays aligned with the tokens."""
    eng = make_engine(toy_path)
    prompt = "The quick brown fox"
    ref = run_all(eng, [prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
    text = eng.tokenizer.decode(ref.token_ids).replace("\ufffd", "")
    stop = text[2:4]
    first_cut = text.index(stop)
    eng = make_engine(toy_path)
    eng.want_text = True
    eng.add_request(
        "m", prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop], min_tokens=12)
    )
    deltas, final = [], None
    while eng.has_unfinished_requests():
        for o in eng.step():
            deltas.append(o.new_text)
            final = o
    assert len(final.token_ids) >= 12
    assert "".join(deltas) == final.text
    full = eng.tokenizer.decode(ref.token_ids)
    assert full.startswith(final.text)
    # The match before min_tokens was not taken: the cut (if any) lies in text searched from token 12 on.
    before = eng.tokenizer.decode(ref.token_ids[:11]).rstrip("\ufffd")
    assert len(final.text) >= len(before) - (len(stop) - 1) > first_cut


def test_counter_based_noise_samples_the_softmax():
    """The exponential race on hashed uniforms draws from softmax(logits / T) restricted to top-k / top-p:
    empirical frequencies over 40,000 (seed, counter) keys, within 5 standard deviations."""
    from ouro_backend.model.sampler import SamplerMode, sample, vocab_hashes

    V, N = 8, 40_000
    logits = torch.log(torch.tensor([0.30, 0.20, 0.15, 0.12, 0.10, 0.07, 0.04, 0.02]))[None].repeat(N, 1)
    seed = torch.full((N,), 1234, dtype=torch.int64)
    counter = torch.arange(N, dtype=torch.int64)
    for temp, top_k, top_p in ((1.0, 0, 1.0), (0.5, 0, 1.0), (1.0, 3, 1.0), (1.0, 0, 0.6)):
        tok, _ = sample(
            logits,
            SamplerMode.SAMPLE,
            torch.full((N,), temp),
            torch.full((N,), top_k),
            torch.full((N,), top_p),
            seed,
            counter,
            vocab_hashes(V, torch.device("cpu")),
        )
        p = torch.softmax(logits[0] / temp, -1)
        if top_k:
            p[top_k:] = 0
        if top_p < 1:
            keep = (p.cumsum(0) - p) < top_p
            p = torch.where(keep, p, 0.0)
        p = p / p.sum()
        freq = torch.bincount(tok, minlength=V).double() / N
        sd = (p * (1 - p) / N).sqrt().clamp_min(1e-12)
        assert ((freq - p).abs() <= 5 * sd + 1e-9).all(), (temp, top_k, top_p, freq, p)

    # The same (seed, counter) gives the same draw; another seed other draws.
    def draw(seeds):
        return sample(
            logits[:100],
            SamplerMode.SAMPLE,
            torch.ones(100),
            torch.zeros(100, dtype=torch.int64),
            torch.ones(100),
            seeds,
            counter[:100],
            vocab_hashes(V, torch.device("cpu")),
        )[0]

    assert torch.equal(draw(seed[:100]), draw(seed[:100])) and not torch.equal(draw(seed[:100]), draw(seed[:100] + 1))
