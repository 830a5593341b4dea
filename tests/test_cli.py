"""The command-line tools run end to end on the toy checkpoint (CPU)."""
import json
import subprocess
import sys

from conftest import ROOT


def run(args, **kw):
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, cwd=ROOT, timeout=300, **kw)


def test_ouro_generate_json(toy_path):
    r = run(["ouro_backend.cli", "Hello world", "The quick", "--max-tokens", "5", "--exit-threshold", "0.5",
             "--json", "--model", toy_path, "--device", "cpu", "--ignore-eos"])
    assert r.returncode == 0, r.stderr
    outs = [json.loads(line) for line in r.stdout.splitlines()]
    assert [o["prompt"] for o in outs] == ["Hello world", "The quick"]
    assert all(len(o["token_ids"]) == 5 and len(o["exit_depths"]) == 5 for o in outs)
    assert all(o["exit_depths"][0] == 4 and o["finish_reason"] == "length" for o in outs)


def test_ouro_generate_bad_option_is_a_clear_error(toy_path):
    r = run(["ouro_backend.cli", "Hi", "--model", toy_path, "--kv-layout", "diagonal"])
    assert r.returncode == 2 and "kv_layout='diagonal'" in r.stderr


def bench(toy_path, tmp_path, *args: str) -> tuple[dict, str]:
    """Run ouro-bench on the toy (CPU) with `args`; returns its results JSON and stdout."""
    out = tmp_path / "bench.json"
    r = run(["ouro_backend.bench", "--model", toy_path, "--input-len", "8", "--engine-arg", "device=cpu",
             "--out", str(out), *args])
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(out.read_text()), r.stdout


def test_ouro_bench_smoke(toy_path, tmp_path):
    res, stdout = bench(toy_path, tmp_path, "--output-len", "4", "--concurrency", "2", "--num-requests", "3",
                        "--repeats", "2", "--workload", "full", "trace=2.5", "--baseline-tokens", "2")
    runs = {x["workload"]: x for x in res["runs"]}
    assert runs["full"]["median"]["requests"] == 3 and runs["full"]["median"]["mean_exit_depth"] == 4.0
    assert len(runs["trace=2.5"]["repeats"]) == 2
    assert 1.0 <= runs["trace=2.5"]["median"]["mean_exit_depth"] < 4.0
    assert res["baseline"] and res["baseline"][0]["output_tok_s"] > 0
    assert "workload" in stdout  # the table


def test_ouro_bench_depth_workload_finds_its_threshold(toy_path, tmp_path):
    """depth=D runs the gate at a threshold whose mean depth on the run's prompts is near D, and says which."""
    res, _ = bench(toy_path, tmp_path, "--output-len", "16", "--concurrency", "2", "--num-requests", "4",
                   "--repeats", "1", "--workload", "full", "depth=2.0", "--baseline", "none")
    runs = {x["target"]: x for x in res["runs"]}
    gated = runs["depth=2.0"]
    threshold = float(gated["workload"].removeprefix("threshold="))
    assert 0.0 < threshold < 1.0
    assert abs(gated["median"]["mean_exit_depth"] - 2.0) < 0.5  # repeat 0 is the prompts it was found on
    full = runs["full"]["median"]
    assert 0.5 < full["decode_occupancy"] <= 1.0 and 0.0 <= full["tail_frac"] < 1.0
    assert gated["median"]["decode_occupancy"] < full["decode_occupancy"]


def test_ouro_bench_poisson_arrivals_with_natural_eos(toy_path, tmp_path):
    """Open loop: the run lasts at least until its last (seeded Poisson) arrival; with every non-special id
    an EOS, natural EOS ends each request at its first token."""
    eos = ",".join(str(i) for i in range(3, 1024))  # the toy's vocabulary, past its special ids
    res, _ = bench(toy_path, tmp_path, "--output-len", "12", "--concurrency", "4", "--num-requests", "6",
                   "--repeats", "1", "--arrival-rate", "20", "--natural-eos", "--baseline", "none",
                   "--engine-arg", f"eos_token_ids={eos}")
    assert res["arrival_rate"] == 20.0 and res["natural_eos"] is True
    m = res["runs"][0]["median"]
    assert m["requests"] == 6 and m["generated_tokens"] == 6
    assert 0.0 < m["last_arrival_s"] <= m["wall_s"]
