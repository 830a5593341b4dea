"""Self-speculative decoding (ouro_backend/engine/speculation.py) against plain full-depth decoding, fp32 on CPU:
greedy tokens identical (logprobs within fp32 batching noise) for every K and d, batched with different
prompt lengths, staggered arrivals, aborts, stop strings, EOS and max_tokens inside an accepted run;
seeded sampled tokens identical to plain sampling's, and their distribution checked by chi-square; the
automatic fallback; served through tritonserver; clear errors for what it cannot serve."""

import pytest
from engine_helpers import ORACLE_PROMPTS as PROMPTS

from ouro_backend import LLM, LLMEngine, SamplingParams
from ouro_backend.config import ConfigError, EngineConfig
from ouro_backend.engine.llm_engine import RequestError
from ouro_backend.engine.spec_policy import SpecPolicy
from ouro_backend.models import DEMO_MODEL

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def make(model, **kw) -> LLMEngine:
    kw.setdefault("spec_auto", False)  # speculate on every launch it can: the exactness tests need the drafts
    kw = dict(dict(block_size=4, num_blocks=512, max_num_seqs=8), **kw)
    return LLMEngine(EngineConfig(model=str(model), device="cpu", dtype="float32", **kw))


def drive(eng, arrivals, aborts=()):
    """arrivals: {step: [(request id, prompt, params)]}; aborts: {step: [request id]}. Runs to the end."""
    outs, step = {}, 0
    arrivals, aborts = dict(arrivals), dict(aborts)
    while arrivals or eng.has_unfinished_requests():
        for rid, prompt, params in arrivals.pop(step, []):
            eng.add_request(rid, prompt, params)
        for rid in dict(aborts).pop(step, []):
            eng.abort_request(rid)
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
        step += 1
    assert eng.kv.pool.num_available == eng.kv.num_blocks, "KV blocks leaked"
    return outs


def batch(model, params=GREEDY, **kw):
    outs = drive(make(model, **kw), {0: [(str(i), p, params) for i, p in enumerate(PROMPTS)]})
    return [outs[str(i)] for i in range(len(PROMPTS))]


def assert_same(plain, spec):
    for a, b in zip(plain, spec):
        assert b.token_ids == a.token_ids
        assert b.exit_depths == a.exit_depths
        assert b.finish_reason == a.finish_reason
        assert max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs)), default=0.0) < 1e-4


@pytest.fixture(scope="module")
def plain_toy(toy_path):
    return batch(toy_path)


@pytest.mark.parametrize("K", [1, 4, 7])
@pytest.mark.parametrize("d", [1, 2, 3])
def test_greedy_equals_plain_decoding(toy_path, plain_toy, K, d):
    eng = make(toy_path, spec_tokens=K, spec_draft_loops=d)
    outs = drive(eng, {0: [(str(i), p, GREEDY) for i, p in enumerate(PROMPTS)]})
    assert_same(plain_toy, [outs[str(i)] for i in range(len(PROMPTS))])
    st = eng.stats()
    assert st["spec_steps"] > 0 and 0 <= st["spec_accepted"] <= st["spec_drafted"]
    per_request = [outs[str(i)] for i in range(len(PROMPTS))]  # the engine's counts, split by request
    assert sum(o.num_spec_drafted for o in per_request) == st["spec_drafted"]
    assert sum(o.num_spec_accepted for o in per_request) == st["spec_accepted"]


def test_demo_model_drafts_are_accepted():
    """On the trained demo model the early loops agree with the last often: real acceptance."""
    prompts = ["Once upon a time, there was a little", "My dear friend,", "The weather today is"]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = LLM(model=str(DEMO_MODEL), device="cpu", dtype="float32").generate(prompts, params)
    spec = LLM(model=str(DEMO_MODEL), device="cpu", dtype="float32", spec_tokens=4, spec_draft_loops=3, spec_auto=False)
    got = spec.generate(prompts, params)
    assert_same(plain, got)
    st = spec.engine.stats()
    assert st["spec_accepted"] / st["spec_drafted"] > 0.5, st


def test_staggered_arrivals_and_aborts(toy_path):
    long = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    arrivals = {
        0: [("a", PROMPTS[0], GREEDY)],
        2: [("b", PROMPTS[1], long)],
        3: [("c", PROMPTS[2], GREEDY)],
        7: [("d", PROMPTS[1], GREEDY)],
    }
    plain = {rid: drive(make(toy_path), {0: [(rid, p, sp)]})[rid] for reqs in arrivals.values() for rid, p, sp in reqs}
    outs = drive(make(toy_path, spec_tokens=4, spec_draft_loops=2), arrivals, aborts={5: ["b"]})
    for rid in "acd":
        assert_same([plain[rid]], [outs[rid]])
    b = outs["b"]
    assert b.finish_reason == "abort" and b.token_ids == plain["b"].token_ids[: len(b.token_ids)]


def test_stop_string_eos_and_max_tokens_inside_a_run():
    llm_plain = LLM(model=str(DEMO_MODEL), device="cpu", dtype="float32")
    llm_spec = LLM(
        model=str(DEMO_MODEL), device="cpu", dtype="float32", spec_tokens=7, spec_draft_loops=3, spec_auto=False
    )
    prompt = "She looked at him and said"
    full = llm_plain.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))[0]
    words = full.text.split()
    stop = " ".join(words[4:6])  # a stop string that shows up mid-text, very likely inside an accepted run
    cases = [
        SamplingParams(max_tokens=30, temperature=0.0, stop=[stop]),
        SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),  # ends inside a run of K=7
        SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[full.token_ids[9]]),
    ]
    for params in cases:
        a = llm_plain.generate([prompt], params)[0]
        b = llm_spec.generate([prompt], params)[0]
        assert (b.text, b.token_ids, b.finish_reason) == (a.text, a.token_ids, a.finish_reason), params
    assert stop not in llm_spec.generate([prompt], cases[0])[0].text
    eos = full.token_ids[12]  # the model's EOS set to a token it emits: the device stops the row itself
    a = LLM(model=str(DEMO_MODEL), device="cpu", dtype="float32", eos_token_ids=[eos]).generate(
        [prompt], SamplingParams(max_tokens=30, temperature=0.0)
    )[0]
    b = LLM(
        model=str(DEMO_MODEL),
        device="cpu",
        dtype="float32",
        eos_token_ids=[eos],
        spec_tokens=7,
        spec_draft_loops=3,
        spec_auto=False,
    ).generate([prompt], SamplingParams(max_tokens=30, temperature=0.0))[0]
    assert b.token_ids == a.token_ids and a.token_ids[-1] == eos and a.finish_reason == b.finish_reason == "stop"


@pytest.mark.parametrize("K,d", [(1, 1), (4, 2), (7, 3)])
def test_sampled_output_equals_plain_sampling(toy_path, K, d):
    """Coupled sampling: speculation draws each token with plain sampling's own noise, so seeded sampled
    requests (mixed with greedy ones, top-k and top-p included) produce plain sampling's tokens."""
    reqs = {
        0: [
            ("g", PROMPTS[0], GREEDY),
            ("s1", PROMPTS[1], SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)),
            ("s2", PROMPTS[2], SamplingParams(max_tokens=16, temperature=1.3, top_k=5, seed=11, ignore_eos=True)),
        ],
        3: [("s3", PROMPTS[0], SamplingParams(max_tokens=10, temperature=0.5, seed=3, ignore_eos=True))],
    }
    plain = drive(make(toy_path), reqs)
    eng = make(toy_path, spec_tokens=K, spec_draft_loops=d)
    spec = drive(eng, reqs)
    for rid in plain:
        assert_same([plain[rid]], [spec[rid]])
    assert eng.stats()["spec_steps"] > 0


def test_sampled_distribution_chi_square(toy_path, oracle):
    """Over many seeds, the first three sampled tokens of a speculating engine (the second and third come
    out of a draft/verify step, the third only right if the step handled acceptance right) follow the
    model's tempered top-k distribution, computed by the dense oracle."""
    import torch

    prompt, temp, k, n = PROMPTS[1], 1.5, 2, 1600
    params = [SamplingParams(max_tokens=3, temperature=temp, top_k=k, seed=s, ignore_eos=True) for s in range(n)]
    eng = make(toy_path, spec_tokens=3, spec_draft_loops=1, max_num_seqs=64, num_blocks=2048)
    outs = drive(eng, {0: [(str(i), prompt, p) for i, p in enumerate(params)]})
    assert eng.stats()["spec_accepted"] > 0

    def dist(tokens):
        logits = oracle.forward(tokens, len(prompt), [4] * len(tokens)).logits[-1] / temp
        top = logits.topk(k)
        return dict(zip(top.indices.tolist(), torch.softmax(top.values, -1).tolist()))

    expected = {}
    for t1, p1 in dist(prompt).items():
        for t2, p2 in dist(prompt + [t1]).items():
            for t3, p3 in dist(prompt + [t1, t2]).items():
                expected[(t1, t2, t3)] = n * p1 * p2 * p3
    observed = dict.fromkeys(expected, 0)
    for o in outs.values():
        triple = tuple(o.token_ids)
        assert triple in expected, triple  # nothing outside the top-k support
        observed[triple] += 1
    chi2 = sum((observed[c] - e) ** 2 / e for c, e in expected.items())
    assert len(expected) == 8 and min(expected.values()) > 5
    assert chi2 < 24.3, (chi2, observed, expected)  # the 99.9% quantile of chi-square with 7 dof


def test_bad_options_and_requests_are_clear_errors(toy_path):
    for kw, words in [
        (dict(spec_tokens=-1), "spec_tokens"),
        (dict(spec_tokens=33), "spec_tokens"),
        (dict(spec_tokens=4, spec_draft_loops=0), "spec_draft_loops"),
        (dict(spec_tokens=4, kv_layout="shared"), "last_exited"),
        (dict(spec_tokens=4, exit_mode="trace"), "trace"),
        (dict(spec_tokens=4, exit_threshold=0.5), "full depth"),
    ]:
        with pytest.raises(ConfigError, match=words):
            EngineConfig(model=toy_path, **kw).validate()
    with pytest.raises(ConfigError, match="spec_draft_loops"):
        make(toy_path, spec_tokens=2, spec_draft_loops=4)
    eng = make(toy_path, spec_tokens=2, spec_draft_loops=2)
    for params in (SamplingParams(exit_threshold=0.7), SamplingParams(max_loops=2)):
        with pytest.raises(RequestError, match="full depth"):
            eng.add_request("x", PROMPTS[0], params)
    assert drive(eng, {0: [("ok", PROMPTS[1], GREEDY)]})["ok"].finish_reason == "length"  # still serving


def test_fallback_policy_cost_model_and_estimator():
    p = SpecPolicy(K=8, d=1, T=4, auto=True, max_verify_tokens=256)
    assert p.expected_gain(0.9) == pytest.approx(sum(0.9**i for i in range(9)) * 4 / 12)  # about 2.04
    assert p.expected_gain(0.0) < 1.0 < p.expected_gain(1.0)
    assert p.decide(28) and not p.decide(29)  # 29 x 9 verify tokens > 256: compute-bound, no drafts
    for drafted in range(8, 8 * 200, 8):  # every step accepts 1 of 8: the estimate falls to 1/8
        p.observe(drafted, drafted // 8)
    assert p.acceptance == pytest.approx(0.125, abs=1e-6)
    decisions = [p.decide(1) for _ in range(64)]
    assert sum(decisions) == 4 and decisions[15]  # it only probes, every 16th launch
    rng = __import__("random").Random(0)
    q, drafted, accepted = SpecPolicy(K=4, d=1, T=4, auto=True, max_verify_tokens=256), 0, 0
    for _ in range(100_000):  # long runs stay inside [0, 1] and near the true rate (no drift)
        drafted += 4
        accepted += sum(rng.random() < 0.7 for _ in range(4))
        q.observe(drafted, accepted)
    assert 0.6 < q.acceptance < 0.8
    assert SpecPolicy(K=4, d=3, T=4, auto=False, max_verify_tokens=1).decide(64)  # auto off: always


def test_automatic_fallback_stops_drafting_when_it_does_not_pay(toy_path, plain_toy):
    """The random toy's early loops rarely agree with the last: the engine soon decodes without drafts,
    probing now and then, and its output stays exact."""
    eng = make(toy_path, spec_tokens=4, spec_draft_loops=3, spec_auto=True)
    outs = drive(eng, {0: [(str(i), p, GREEDY) for i, p in enumerate(PROMPTS)]})
    assert_same(plain_toy, [outs[str(i)] for i in range(len(PROMPTS))])
    st = eng.stats()
    assert 0 < st["spec_steps"] < st["launches"] // 2, st
    policy = eng.scheduler.spec_policy
    assert policy.expected_gain(policy.acceptance) < 1.0


def test_served_speculation_text_equals_plain_and_metrics_show_acceptance(tmp_path):
    """Through the real tritonserver and the `ouro` model (gRPC streaming, the demo model): the text equals
    plain greedy decoding, and the metrics port shows the acceptance."""
    import re
    import time
    import urllib.request

    from client.ouro_client import generate, request_options
    from ouro_backend.entrypoints.tritonserver import ServerError, TritonServer, find_tritonserver, free_port

    try:
        find_tritonserver()
    except ServerError as e:
        pytest.skip(f"no tritonserver available: {e}")
    args = dict(device="cpu", dtype="float32", spec_tokens=4, spec_draft_loops=3, spec_auto=False)
    srv = TritonServer(
        model=str(DEMO_MODEL),
        engine_args=args,
        address="127.0.0.1",
        http_port=free_port(),
        grpc_port=free_port(),
        metrics_port=free_port(),
    )
    prompt = "Once upon a time, there was a little"
    plain = (
        LLM(model=str(DEMO_MODEL), device="cpu", dtype="float32")
        .generate([prompt], SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))[0]
        .text
    )
    try:
        srv.start(timeout=300)
        res = generate(
            srv.grpc_url,
            "ouro",
            prompt,
            request_options(max_tokens=32, temperature=0.0, ignore_eos=True, return_spec_counts=True),
        )
        assert res.error is None and res.text == plain

        offline = LLM(model=str(DEMO_MODEL), **args)
        out = offline.generate([prompt], SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))[0]
        want = offline.engine.stats()["spec_acceptance_rate"]  # the same request on an idle engine
        # The request's own counts come with its final response (and equal the offline request's).
        final = res.chunks[-1]
        assert (final.num_spec_drafted_tokens, final.num_spec_accepted_tokens) == (
            out.num_spec_drafted,
            out.num_spec_accepted,
        )
        assert out.num_spec_drafted > 0 and 0 < out.num_spec_accepted <= out.num_spec_drafted

        def acceptance():
            text = urllib.request.urlopen(srv.metrics_url, timeout=10).read().decode()
            m = re.search(r'^ouro_spec_acceptance_rate\{[^}]*model="ouro_engine"[^}]*\} (\S+)$', text, re.M)
            return float(m.group(1)) if m else None

        deadline = time.monotonic() + 15  # the engine publishes a snapshot every 0.25 s
        while acceptance() != pytest.approx(want) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert acceptance() == pytest.approx(want) and want > 0.5, (acceptance(), want)
    finally:
        assert srv.stop() == 0, srv.log_tail()
