"""The command-line tools run end to end on the toy checkpoint (CPU)."""

import json
import subprocess
import sys

import pytest
from conftest import ROOT


def run(args, **kw):
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, cwd=ROOT, timeout=300, **kw)


def test_ouro_generate_json(toy_path):
    r = run(
        [
            "ouro_backend.entrypoints.cli",
            "Hello world",
            "The quick",
            "--max-tokens",
            "5",
            "--exit-threshold",
            "0.5",
            "--json",
            "--model",
            toy_path,
            "--device",
            "cpu",
            "--ignore-eos",
        ]
    )
    assert r.returncode == 0, r.stderr
    outs = [json.loads(line) for line in r.stdout.splitlines()]
    assert [o["prompt"] for o in outs] == ["Hello world", "The quick"]
    assert all(len(o["token_ids"]) == 5 and len(o["exit_depths"]) == 5 for o in outs)
    assert all(o["exit_depths"][0] == 4 and o["finish_reason"] == "length" for o in outs)


def test_ouro_generate_bad_option_is_a_clear_error(toy_path):
    r = run(["ouro_backend.entrypoints.cli", "Hi", "--model", toy_path, "--kv-layout", "diagonal"])
    assert r.returncode == 2 and "kv_layout='diagonal'" in r.stderr


def test_ouro_generate_with_deferred_deep_batching(toy_path):
    """`--deferred-deep-interval B`: token 0 at full depth, then loop 2 with loop 4 at every B-th; a request
    setting its own depth is refused clearly."""
    base = ["ouro_backend.entrypoints.cli", "Hello world", "--max-tokens", "9", "--json", "--model", toy_path]
    base += ["--device", "cpu", "--ignore-eos", "--deferred-deep-interval", "4"]
    r = run(base)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["exit_depths"] == [4, 2, 2, 2, 4, 2, 2, 2, 4]
    r = run([*base, "--exit-threshold", "0.5"])
    assert r.returncode == 2 and "fixes every token's depth" in r.stderr


def bench(toy_path, tmp_path, *args: str) -> tuple[dict, str]:
    """Run ouro-bench on the toy (CPU) with `args`; returns its results JSON and stdout."""
    out = tmp_path / "bench.json"
    r = run(
        [
            "ouro_backend.entrypoints.bench",
            "--model",
            toy_path,
            "--input-len",
            "8",
            "--engine-arg",
            "device=cpu",
            "--out",
            str(out),
            *args,
        ]
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(out.read_text()), r.stdout


def test_ouro_bench_smoke(toy_path, tmp_path):
    res, stdout = bench(
        toy_path,
        tmp_path,
        "--output-len",
        "4",
        "--concurrency",
        "2",
        "--num-requests",
        "3",
        "--repeats",
        "2",
        "--workload",
        "full",
        "trace=2.5",
        "--baseline-tokens",
        "2",
    )
    runs = {x["workload"]: x for x in res["runs"]}
    assert runs["full"]["median"]["requests"] == 3 and runs["full"]["median"]["mean_exit_depth"] == 4.0
    assert len(runs["trace=2.5"]["repeats"]) == 2
    assert 1.0 <= runs["trace=2.5"]["median"]["mean_exit_depth"] < 4.0
    assert res["baseline"] and res["baseline"][0]["output_tok_s"] > 0
    assert "workload" in stdout  # the table


def test_ouro_bench_deferred_deep_rows(toy_path, tmp_path):
    """A deferred engine runs workload `deferred` (the default then) and reports deep_rows_per_call; the
    eager control runs no deep chunks; a gated workload on such an engine is refused."""
    args = ["--output-len", "12", "--concurrency", "3", "--num-requests", "3", "--repeats", "1", "--baseline", "none"]
    res, _ = bench(toy_path, tmp_path, *args, "--engine-arg", "deferred_deep_interval=4")
    m = res["runs"][0]["median"]
    assert res["runs"][0]["workload"] == "deferred" and m["deferred_deep_interval"] == 4
    assert m["mean_exit_depth"] == (2 * 4 + 9 * 2) / 11  # tokens 1..11: loop 4 at 4 and 8, loop 2 otherwise
    assert m["deep_rows_per_call"] == 3 * 4  # three requests arrive together: their boundaries are aligned
    eager_args = ["--engine-arg", "deferred_deep_interval=4", "--engine-arg", "deferred_deep_eager=true"]
    eager, _ = bench(toy_path, tmp_path, *args, *eager_args)
    assert eager["runs"][0]["median"]["deep_rows_per_call"] is None
    r = run(
        ["ouro_backend.entrypoints.bench", "--model", toy_path, "--engine-arg", "device=cpu", "--workload", "depth=2"]
        + ["--engine-arg", "deferred_deep_interval=4"]
    )
    assert r.returncode == 2 and "--workload deferred only" in r.stderr


def test_ouro_bench_depth_workload_finds_its_threshold(toy_path, tmp_path):
    """depth=D runs the gate at a threshold whose mean depth on the run's prompts is near D, and says which."""
    res, _ = bench(
        toy_path,
        tmp_path,
        "--output-len",
        "16",
        "--concurrency",
        "2",
        "--num-requests",
        "4",
        "--repeats",
        "1",
        "--workload",
        "full",
        "depth=2.0",
        "--baseline",
        "none",
        "--input-len",
        "40",
    )
    runs = {x["workload"]: x for x in res["runs"]}
    gated = runs["depth=2.0"]
    assert 0.0 < gated["median"]["threshold"] < 1.0 and runs["full"]["median"]["threshold"] == 1.0
    assert abs(gated["median"]["mean_exit_depth"] - 2.0) < 0.5  # found on the repeat's own prompts
    full = runs["full"]["median"]
    # The calibration ran the same prompts: the timed run must still prefill them (the toy's blocks are 16).
    assert gated["median"]["cached_prompt_tokens"] == 0 == full["cached_prompt_tokens"]
    assert 0.5 < full["decode_occupancy"] <= 1.0 and 0.0 <= full["tail_frac"] < 1.0
    assert gated["median"]["decode_occupancy"] < full["decode_occupancy"]
    # The ideal closed loop on the run's own requests: full depth is 2 waves of 16 tokens x 4 loops, and no
    # run takes fewer rounds than its ideal (an engine advances a request by at most one loop a round).
    assert full["ideal_rounds"] == 2 * 16 * 4 and full["request_loops"] == 4 * 16 * 4
    for run in runs.values():
        for rep in run["repeats"]:
            assert rep["rounds"] >= rep["ideal_rounds"] > 0
    assert gated["median"]["ideal_rounds"] < full["ideal_rounds"]
    # Against the full-depth run: the gated run's share of the loop-ideal speed-up, by the definition.
    m, T = gated["median"], 4
    assert m["ratio_vs_full"] == pytest.approx(m["output_tok_s"] / full["output_tok_s"])
    P = m["prompt_s_yardstick"]
    assert P > 0 and m["loop_ideal_ratio"] == pytest.approx(
        full["wall_s"] / (P + (full["wall_s"] - P) * m["mean_exit_depth"] / T)
    )
    assert m["loop_efficiency"] == pytest.approx(m["ratio_vs_full"] / m["loop_ideal_ratio"])
    assert "loop_efficiency" not in full


def test_gpu_by_launch_sorts_launches_by_kind():
    from ouro_backend.entrypoints.bench import gpu_by_launch

    # (device seconds, prompt tokens, decode rows, rounds, speculative)
    out = gpu_by_launch(
        [(0.002, 128, 0, 1, False), (0.003, 300, 64, 1, False), (0.004, 0, 64, 4, False), (0.001, 0, 8, 1, True)]
        + [(0.005, 2000, 3, 1, False)]
    )
    assert out["prompt<=128"] == dict(gpu_s=0.002, launches=1, rounds=1, ms_per_round=pytest.approx(2.0))
    assert out["mixed<=512"]["launches"] == 1 and out["mixed>1024"]["gpu_s"] == 0.005
    assert out["decode<=64"]["rounds"] == 4 and out["decode<=64"]["ms_per_round"] == pytest.approx(1.0)
    assert out["spec<=16"]["launches"] == 1 and out["decode<=16"]["launches"] == 0
    assert out["decode>64"] == dict(gpu_s=0.0, launches=0, rounds=0, ms_per_round=None)  # listed, empty


def test_loop_params_counts_one_loop_of_the_shared_stack(toy_path):
    from ouro_backend import EngineConfig, LLMEngine
    from ouro_backend.entrypoints.bench import loop_params
    from ouro_backend.model.checkpoint import load_config

    cfg = load_config(toy_path)
    engine = LLMEngine(EngineConfig(model=toy_path, device="cpu", cuda_graphs=False))
    H, I, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * D * H
    per_layer = qkv + cfg.num_attention_heads * D * H + 3 * I * H + 4 * H  # + o, gate/up/down, four norms
    assert loop_params(engine) == cfg.num_hidden_layers * per_layer


def test_ideal_rounds_replaces_each_finished_request_in_the_next_round():
    from ouro_backend.entrypoints.bench import ideal_rounds

    # Two slots: 3 | 1, then 2 in the freed slot (rounds 1-2), then 2 after the 3 (rounds 3-4).
    assert ideal_rounds([3, 1, 2, 2], 2) == 5
    assert ideal_rounds([5], 8) == 5 and ideal_rounds([], 4) == 0
    assert ideal_rounds([4] * 8, 4) == 8  # two full waves
    assert ideal_rounds([1, 1, 1, 9], 2) == 10  # the deep request comes last: it alone sets the end


def test_ouro_bench_poisson_arrivals_with_natural_eos(toy_path, tmp_path):
    """Open loop: the run lasts at least until its last (seeded Poisson) arrival; with every id an EOS
    (--eos-every 1), natural EOS ends each request at its first token."""
    res, _ = bench(
        toy_path,
        tmp_path,
        "--output-len",
        "12",
        "--concurrency",
        "4",
        "--num-requests",
        "6",
        "--repeats",
        "1",
        "--arrival-rate",
        "20",
        "--natural-eos",
        "--eos-every",
        "1",
        "--baseline",
        "none",
    )
    assert res["arrival_rate"] == 20.0 and res["natural_eos"] is True and res["eos_every"] == 1
    assert res["engine_options"]["eos_token_ids"].split(",")[:3] == ["1", "2", "3"]
    m = res["runs"][0]["median"]
    assert m["requests"] == 6 and m["generated_tokens"] == 6
    assert 0.0 < m["last_arrival_s"] <= m["wall_s"]


def test_ouro_bench_arrival_load_is_a_share_of_full_depth_capacity(toy_path, tmp_path):
    res, _ = bench(
        toy_path,
        tmp_path,
        "--output-len",
        "6",
        "--concurrency",
        "2",
        "--num-requests",
        "4",
        "--repeats",
        "1",
        "--arrival-load",
        "0.5",
        "--baseline",
        "none",
    )
    (cap,) = res["capacity"]
    assert res["arrival_load"] == 0.5 and cap["concurrency"] == 2 and cap["capacity_req_s"] > 0
    assert cap["arrival_rate"] == pytest.approx(0.5 * cap["capacity_req_s"])
    m = res["runs"][0]["median"]
    assert m["requests"] == 4 and m["last_arrival_s"] is not None and m["last_arrival_s"] <= m["wall_s"]
    r = run(["ouro_backend.entrypoints.bench", "--model", toy_path, "--arrival-load", "0.8", "--arrival-rate", "3"])
    assert r.returncode == 2 and "--arrival-load F needs 0 < F <= 2 and no --arrival-rate" in r.stderr


def test_ouro_bench_min_output_len_draws_each_requests_length(toy_path, tmp_path):
    """--min-output-len: each request's max_tokens is drawn from [min, --output-len] (EOS still ignored)."""
    res, _ = bench(
        toy_path,
        tmp_path,
        "--output-len",
        "12",
        "--min-output-len",
        "2",
        "--concurrency",
        "4",
        "--num-requests",
        "12",
        "--repeats",
        "1",
        "--baseline",
        "none",
    )
    m = res["runs"][0]["median"]
    assert res["min_output_len"] == 2 and m["requests"] == 12
    assert 2 * 12 <= m["generated_tokens"] < 12 * 12  # not all 12 long (seeded draw)
    r = run(["ouro_backend.entrypoints.bench", "--model", toy_path, "--output-len", "4", "--min-output-len", "5"])
    assert r.returncode == 2 and "--min-output-len must be in [1, --output-len=4], got 5" in r.stderr
    r = run(["ouro_backend.entrypoints.bench", "--model", toy_path, "--eos-every", "3"])
    assert r.returncode == 2 and "--eos-every needs --natural-eos" in r.stderr


def test_closed_loop_leaves_nothing_in_flight(toy_path):
    """With async scheduling the step that finishes a run's last request has already launched more work; the
    run collects it, so nothing is in flight after it (a following run would read it back first)."""
    from engine_helpers import make_recording_engine

    from ouro_backend.entrypoints.bench import run_closed_loop

    eng = make_recording_engine(toy_path, async_scheduling=True)
    res = run_closed_loop(eng, 6, 5, 4, 8, "full")
    assert res["requests"] == 8 and res["generated_tokens"] == 40
    assert not eng.has_unfinished_requests() and eng.kv.pool.num_available == eng.kv.num_blocks
