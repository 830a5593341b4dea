"""The client tools as users run them (issue 26): client/perf_analyzer/run_perf.py's defaults and failure hints
and its first-response latency, the tokenizer client/genai_perf/run_genai_perf.py picks by default, and what
client/ouro_client.py prints without streaming. The served ones run against a REAL tritonserver on the demo
model (`demo_server`, conftest.py); genai-perf's own run on it is in test_genai_perf.py."""

from __future__ import annotations

import json
import math
import os
import shutil
import sys

import pytest
from server_common import PROMPT

from client import ouro_client
from client.genai_perf import run_genai_perf as genai_recipe
from client.ouro_client import Chunk, Result, generate, request_options
from ouro_backend.models import DEMO_MODEL

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "client", "perf_analyzer"))
import run_perf
from locate import PerfAnalyzerUnavailable

MODEL_ENV = ("OURO_MODEL_PATH", "OURO_ENGINE_ARGS", "OURO_MODEL_REPOSITORY")


@pytest.fixture(scope="module")
def seconds_per_token(demo_server) -> float:
    """This machine's time per token on the demo model at concurrency 1: the faster of two streamed 64-token
    requests (the first after a server start is slower)."""
    n, times = 64, []
    options = request_options(max_tokens=n, ignore_eos=True, temperature=0.0)
    for _ in range(2):
        r = generate(demo_server.grpc_url, "ouro", PROMPT, options)
        assert r.error is None and r.num_tokens == n, r.error
        times.append((r.end - r.start) / n)
    return min(times)


def perf_or_skip(argv: list[str], capsys) -> tuple[int, dict, str]:
    """run_perf.main(argv): (exit code, its JSON report, its stderr); a skip when perf_analyzer cannot run."""
    try:
        run_perf.locate()
    except PerfAnalyzerUnavailable as e:
        pytest.skip(f"perf_analyzer cannot run here: {e}")
    code = run_perf.main(argv)
    captured = capsys.readouterr()
    return code, json.loads(captured.out), captured.err


# ---- 1. run_perf.py: defaults that work when a request outlasts a time window, TTFT measured, hints ----


@pytest.mark.timeout(600)
def test_run_perf_defaults_work_when_a_request_outlasts_the_old_time_window(
    demo_server, seconds_per_token, tmp_path, capsys
):
    """At its defaults run_perf.py used 3 s time windows (perf_analyzer waits 1.2 x that): with requests of
    about 4.5 s, three windows in a row cannot each see a request finish, and perf_analyzer exits 1 with "No
    valid requests recorded within time interval". Count windows do not depend on a request's duration."""
    max_tokens = min(1800, math.ceil(4.5 / seconds_per_token))  # ~4.5 s a request (context: 2048)
    code, report, err = perf_or_skip(
        ["--url", demo_server.grpc_url, "--models", "ouro", "--concurrency", "1", "--max-tokens", str(max_tokens)]
        + ["--out-dir", str(tmp_path)],
        capsys,
    )
    (r,) = report["runs"]
    assert code == 0 and report["ok"], json.dumps(r, indent=1)
    assert r["measurement"] == {"mode": "count_windows", "requests_per_window": 3}
    assert r["request_count"] >= 9  # three windows (stability) of at least three requests
    # perf_analyzer's latency is the whole request (to the last response); the first response comes far earlier.
    ttft = r["first_response_latency_ms"]
    assert ttft is not None and r["warnings"] == [], r["warnings"]
    assert abs(ttft["count"] - r["request_count"]) <= 1, (ttft, r["request_count"])
    assert 0 < ttft["p50"] < r["request_latency_p50_us"] / 1e3 / 5, (ttft, r["request_latency_p50_us"])
    assert "request latency (send to last response)" in err and "first response (TTFT) p50" in err
    assert "first-response latency avg" not in err  # the old label, on the whole request's latency
    assert 0.5 < r["mean_in_flight"] <= 1.05  # one request at a time, each sent as the previous ends
    assert 0.5 < r["measured_in_flight"] <= 1.05, r["measured_in_flight"]  # the same, from the export
    # one unmeasured request first: perf_analyzer was told, and the export holds the measured ones only
    assert r["warmup_requests"] == 1 and "--warmup-request-count 1" in open(r["log"]).readline()
    assert r["stability_percentage"] == 999 and "--stability-percentage 999 " in open(r["log"]).readline()
    assert len(json.load(open(r["profile_export"]))["experiments"][0]["requests"]) == r["request_count"]
    timeline = json.load(open(r["request_timeline"]))  # the export's request times, written beside it
    assert len(timeline["requests"]) == r["request_count"] and len(timeline["window_boundaries"]) >= 4
    assert all(q["send"] < q["first"] <= q["last"] and q["responses"] >= 1 for q in timeline["requests"])


def test_run_perf_failure_prints_a_hint(demo_server, seconds_per_token, tmp_path, capsys):
    """Time windows far shorter than a request fail, and the failure says what to change. Requests of about
    2 s against 100 ms windows (perf_analyzer waits 120 ms): even if the machine gets several times faster
    than it was when calibrated, three windows in a row cannot each see a request finish."""
    max_tokens = max(64, math.ceil(2.0 / seconds_per_token))
    code, report, err = perf_or_skip(
        ["--url", demo_server.grpc_url, "--models", "ouro", "--concurrency", "1", "--max-tokens", str(max_tokens)]
        + ["--measurement-interval", "100", "--out-dir", str(tmp_path)],
        capsys,
    )
    assert code == 1 and not report["ok"], err
    assert "no request finished inside a 100 ms measurement window" in err
    (r,) = report["runs"]
    assert "Leave out --measurement-interval" in r["hint"] and r["log"] in err
    assert r["measurement"] == {"mode": "time_windows", "interval_ms": 100}


def test_run_perf_unreachable_server_hint(tmp_path, capsys):
    code, report, err = perf_or_skip(
        ["--url", "127.0.0.1:1", "--models", "ouro", "--concurrency", "1", "--out-dir", str(tmp_path)], capsys
    )
    assert code == 1 and not report["ok"]
    assert "cannot reach the server at 127.0.0.1:1" in err


@pytest.mark.unit
def test_first_response_latency_from_profile_export(tmp_path):
    """TTFT from perf_analyzer's profile export: first response minus send, only requests that end inside
    the measurement windows (as perf_analyzer counts them)."""
    ms = 1_000_000
    export = {
        "experiments": [
            {
                "experiment": {"mode": "concurrency", "value": 1},
                "window_boundaries": [100 * ms, 2000 * ms],
                "requests": [
                    {"timestamp": 50 * ms, "response_timestamps": [60 * ms, 90 * ms]},  # ends before the windows
                    {"timestamp": 100 * ms, "response_timestamps": [110 * ms, 900 * ms]},
                    {"timestamp": 900 * ms, "response_timestamps": [930 * ms, 1000 * ms, 1800 * ms]},
                    {"timestamp": 1800 * ms, "response_timestamps": [1850 * ms, 2500 * ms]},  # ends after them
                ],
            }
        ]
    }
    path = tmp_path / "export.json"
    path.write_text(json.dumps(export))
    stats = run_perf.first_response_latency(run_perf.load_export(str(path)))
    assert stats["count"] == 2 and stats["min"] == 10.0 and stats["max"] == 30.0 and stats["avg"] == 20.0
    assert run_perf.load_export(str(tmp_path / "missing.json")) is None


@pytest.mark.unit
def test_an_empty_profile_export_is_a_warning_not_a_missing_number(tmp_path):
    """perf_analyzer once exited 0 with a full report and a 0-byte profile export (under CPU contention): the
    run keeps its own numbers and says why it has no first-response latency. The binary here is a script that
    prints such a report and leaves such an export."""
    fake = tmp_path / "perf_analyzer"
    fake.write_text(
        "#!/bin/sh\n"
        'while [ $# -gt 0 ]; do [ "$1" = --profile-export-file ] && : > "$2"; shift; done\n'
        'printf "  Client: \\n    Request count: 9\\n    Throughput: 0.2 infer/sec\\n"\n'
        'printf "    Avg latency: 5000000 usec\\n"\n'
    )
    fake.chmod(0o755)
    r = run_perf.run_one(
        str(fake), dict(os.environ), "127.0.0.1:1", "ouro", 1, str(tmp_path / "in.json"), str(tmp_path),
        None, 5, 30, [],
    )  # fmt: skip
    assert r["ok"] and r["request_count"] == 9 and r["first_response_latency_ms"] is None
    assert r["profile_export"] and os.path.getsize(r["profile_export"]) == 0
    assert len(r["warnings"]) == 1 and "unreadable (0 bytes): no first-response latency" in r["warnings"][0]


@pytest.mark.unit
def test_request_timeline_and_measured_in_flight_from_profile_export(tmp_path):
    """The export reduced to each request's times, and from them the requests open on average over the
    measurement windows, each request clipped to them: what perf_analyzer really kept in flight, where its own
    numbers only allow Little's law."""
    ms = 1_000_000
    export = {
        "experiments": [
            {
                "window_boundaries": [1000 * ms, 2000 * ms, 3000 * ms],
                "requests": [
                    {"timestamp": 0, "response_timestamps": [500 * ms, 1500 * ms]},  # 0.5 s inside
                    {"timestamp": 1000 * ms, "response_timestamps": [1200 * ms, 3000 * ms]},  # 2 s
                    {"timestamp": 2500 * ms, "response_timestamps": [2600 * ms, 3500 * ms]},  # 0.5 s
                    {"timestamp": 3100 * ms, "response_timestamps": [3200 * ms]},  # after the windows
                ],
            }
        ]
    }
    path = tmp_path / "export.json"
    path.write_text(json.dumps(export))
    timeline = run_perf.request_timeline(run_perf.load_export(str(path)))
    assert timeline is not None and timeline["window_boundaries"] == [1000 * ms, 2000 * ms, 3000 * ms]
    assert timeline["requests"][1] == {"send": 1000 * ms, "first": 1200 * ms, "last": 3000 * ms, "responses": 2}
    assert run_perf.request_timeline({"experiments": []}) is None
    assert run_perf.measured_in_flight(timeline) == pytest.approx(1.5)  # 3 s over 2 s
    assert run_perf.measured_in_flight({"window_boundaries": [], "requests": []}) is None  # no windows
    # The last send before the windows close: what follows is the drain, left out (2 s over 1.5 s).
    timeline["requests"].pop()
    assert run_perf.measured_in_flight(timeline) == pytest.approx((0.5 + 1.5 + 0.0) / 1.5)


@pytest.mark.unit
def test_run_perf_window_options(capsys):
    assert run_perf.default_request_count(1) == 3 and run_perf.default_request_count(16) == 32
    assert run_perf.default_warmup_count(1) == 1 and run_perf.default_warmup_count(64) == 256
    with pytest.raises(SystemExit):
        run_perf.main(["--measurement-interval", "5000", "--measurement-request-count", "4"])
    assert "excludes" in capsys.readouterr().err
    # perf_analyzer 2.50 hangs on a warm-up of fewer requests than the concurrency: refused before it runs
    with pytest.raises(SystemExit):
        run_perf.main(["--concurrency", "1", "8", "--warmup-request-count", "4"])
    assert "--warmup-request-count 4 is below the concurrency 8" in capsys.readouterr().err
    with pytest.raises(ValueError, match="below the concurrency 4"):
        run_perf.run(concurrency=(4,), warmup_request_count=2)
    for taken in (None, 0, 64, 256):
        run_perf.check_warmup(taken, 64)


@pytest.mark.unit
def test_run_perf_passes_the_stability_check_it_is_given(tmp_path, monkeypatch):
    """``--stability-percentage P`` reaches perf_analyzer's command line (its own check then picks three steady
    windows) and the report; the default is no check (999: the first three windows)."""
    seen = []

    def fake_run(cmd, **kw):
        seen.append(cmd)
        raise FileNotFoundError("no perf_analyzer in this test")  # the command line is all this test needs

    monkeypatch.setattr(run_perf.subprocess, "run", fake_run)
    for given, flag in ((None, "999"), (10.0, "10"), (12.5, "12.5")):
        kw = {} if given is None else {"stability_percentage": given}
        with pytest.raises(FileNotFoundError):
            run_perf.run_one("pa", {}, "u:1", "ouro", 64, "in.json", str(tmp_path), None, 10, 5.0, [], **kw)
        cmd = seen[-1]
        assert cmd[cmd.index("--stability-percentage") + 1] == flag and cmd[cmd.index("--max-trials") + 1] == "10"
    with pytest.raises(SystemExit):
        run_perf.main(["--stability-percentage", "ten"])


@pytest.mark.unit
def test_served_benchmark_prompts_have_no_nul():
    """benchmarks/served.py decodes random token ids into prompts; perf_analyzer reads its input data's strings
    up to the first NUL, so a prompt that began with one reached the server empty ("text_input is empty"),
    and that one error ended the whole perf_analyzer run. Seed 2,000,429 (perf_analyzer's prompt 429 of a
    served.py run on the demo model) decoded to a text starting with NUL."""
    from benchmarks.served import make_prompt

    text, ids = make_prompt(str(DEMO_MODEL), 128, seed=2_000_429)
    assert text and "\x00" not in text and 0 < len(ids) <= 128


@pytest.mark.unit
def test_served_benchmark_direct_runs_the_served_repeats_prompts():
    """benchmarks/served.py: engine-direct's repeat i prefills the token ids the server makes of the first
    served model's repeat i (the gate's depth depends on the prompts, so both sides run the same work), after
    the --depth search's prompts of its own; no prompt repeats within an engine; --direct-prompts own shares
    none with the server, nor do the --process loop's and perf_analyzer's prompts."""
    import argparse

    from benchmarks.served import DEPTH_SEARCH_RUNS, prompt_plan
    from ouro_backend.model.tokenizer import load_tokenizer
    from ouro_backend.serving.protocol import tokenize_arrays

    tok = load_tokenizer(str(DEMO_MODEL))
    base = dict(input_len=12, requests=3, repeats=2, models=["ouro", "ouro_ensemble"], skip_direct=False)
    pa = dict(skip_perf_analyzer=False, perf_analyzer_prompts=4)
    args = argparse.Namespace(**base, **pa, stand_in=False, depth=None, direct_prompts="served", process=True)
    plan = prompt_plan(str(DEMO_MODEL), args)
    served = plan["served"]
    assert [len(b) for b in served["ouro"]] == [3, 3, 3] and len(served["ouro_ensemble"]) == 3
    texts = [t for batches in served.values() for b in batches for t in b]
    assert len(set(texts)) == len(texts) == 18

    def server_ids_of(batch: list[str]) -> list[list[int]]:
        return [tokenize_arrays(tok, t)["input_ids"].reshape(-1).tolist() for t in batch]

    server_ids = server_ids_of(served["ouro"][1] + served["ouro"][2])
    assert plan["direct"] == server_ids
    assert len(plan["perf_analyzer"]) == 4 and not set(plan["perf_analyzer"]) & set(texts)
    every_served = server_ids_of(texts)
    assert len(plan["process"]) == 9 and not any(ids in every_served for ids in plan["process"])

    args.depth = 2.0
    with_search = prompt_plan(str(DEMO_MODEL), args)["direct"]
    search = DEPTH_SEARCH_RUNS * 3
    assert with_search[search:] == server_ids and len(with_search) == search + 6
    assert not any(ids in server_ids for ids in with_search[:search])

    args.depth, args.direct_prompts = None, "own"
    own = prompt_plan(str(DEMO_MODEL), args)["direct"]
    assert len(own) == 6 and not any(ids in every_served for ids in own)
    args.stand_in, args.process, args.skip_perf_analyzer = True, False, True
    assert [prompt_plan(str(DEMO_MODEL), args)[k] for k in ("direct", "process", "perf_analyzer")] == [None] * 3


# ---- 2. run_genai_perf.py: the served model's tokenizer by default ----


@pytest.fixture
def no_model_env(monkeypatch):
    for name in MODEL_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.unit
def test_genai_perf_default_tokenizer_is_the_served_models(no_model_env, tmp_path):
    """Without --tokenizer the recipe tokenizes like the server: `ouro-serve` without --model serves the
    demo model (vocab 4,096), not the random toy checkpoint (vocab 621) it used to pick."""
    assert genai_recipe.served_checkpoint() == str(DEMO_MODEL)
    path, local = genai_recipe.prepare_tokenizer(None, str(tmp_path))
    assert local and path == str(tmp_path / "tokenizer")
    assert (tmp_path / "tokenizer" / "tokenizer.json").read_bytes() == (DEMO_MODEL / "tokenizer.json").read_bytes()


@pytest.mark.unit
def test_genai_perf_served_checkpoint_follows_the_servers_rule(no_model_env, tmp_path, monkeypatch):
    """$OURO_MODEL_PATH (ouro-serve --model), else `model` in $OURO_ENGINE_ARGS, else the repository's
    ouro_engine `model` parameter (relative to the model's directory), else the demo model."""
    a, b, c = (tmp_path / name for name in ("a", "b", "c"))
    for d in (a, b):
        d.mkdir()
    repo = tmp_path / "repo"
    shutil.copytree(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "model_repository"), repo)
    config = repo / "ouro_engine" / "config.pbtxt"
    assert genai_recipe.served_checkpoint(str(repo)) == str(DEMO_MODEL)  # the repository's `model` is empty
    text = config.read_text()
    config.write_text(
        text.replace('key: "model" value: { string_value: "" }', 'key: "model" value: { string_value: "ckpt" }')
    )
    (repo / "ouro_engine" / "ckpt").mkdir()
    assert genai_recipe.served_checkpoint(str(repo)) == str(repo / "ouro_engine" / "ckpt")
    monkeypatch.setenv("OURO_MODEL_REPOSITORY", str(repo))
    assert genai_recipe.served_checkpoint() == str(repo / "ouro_engine" / "ckpt")
    monkeypatch.setenv("OURO_ENGINE_ARGS", f"model={b}")
    assert genai_recipe.served_checkpoint() == str(b)
    monkeypatch.setenv("OURO_MODEL_PATH", str(a))
    assert genai_recipe.served_checkpoint() == str(a)
    assert genai_recipe.served_checkpoint(environ={"OURO_MODEL_PATH": str(b)}) == str(b)
    with pytest.raises(genai_recipe.TokenizerUnavailable, match="--tokenizer"):
        genai_recipe.served_checkpoint(environ={"OURO_MODEL_PATH": str(c)})  # no such directory here


@pytest.mark.unit
def test_genai_perf_cli_reports_an_unknown_served_checkpoint(no_model_env, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("OURO_MODEL_PATH", str(tmp_path / "missing"))
    monkeypatch.setattr(genai_recipe, "genai_perf_command", lambda: ["genai-perf"])
    monkeypatch.setattr(genai_recipe, "locate", lambda: ("/bin/true", {}))
    monkeypatch.setattr(genai_recipe, "check", lambda binary, env: None)
    assert genai_recipe.main(["--url", "localhost:1", "--artifact-dir", str(tmp_path / "out")]) == 2
    assert "pass --tokenizer" in capsys.readouterr().err


# ---- 3. ouro_client.py: only what a request's responses can measure ----


def client_summary(argv: list[str], capsys) -> tuple[int, str, str]:
    code = ouro_client.main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_ouro_client_no_stream_prints_no_decode_rate(demo_server, capsys):
    """`--protocol http --no-stream`: one response at the end, so no first-token time and no decode rate
    (it printed "decode 384535.6 tok/s"): tokens, total time and overall tok/s only."""
    base = [PROMPT, "--protocol", "http", "--url", demo_server.http_url, "--no-stream"]
    base += ["--max-tokens", "16", "--ignore-eos"]
    code, out, err = client_summary(base, capsys)
    assert code == 0, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("--- 16 tokens, finish_reason=length, total "), line
    assert "tok/s overall" in line and line.endswith(", not streamed: no TTFT or decode rate"), line
    measured = line[: -len(", not streamed: no TTFT or decode rate")]
    assert "decode" not in measured and "TTFT" not in measured, line
    code, out, err = client_summary(base + ["--json"], capsys)
    assert code == 0, err
    s = json.loads(out[out.index("{") :])
    assert s["streamed"] is False and s["ttft_s"] is None and s["decode_tokens_per_s"] is None
    assert s["tokens"] == 16 and s["responses"] == 1 and s["total_s"] > 0
    assert s["tokens_per_s"] == pytest.approx(16 / s["total_s"])


def test_ouro_client_streamed_summary_has_ttft_and_a_plausible_decode_rate(demo_server, capsys):
    argv = [PROMPT, "--protocol", "http", "--url", demo_server.http_url, "--max-tokens", "16", "--ignore-eos"]
    code, out, err = client_summary(argv + ["--stream-interval", "1", "--json"], capsys)
    assert code == 0, err
    s = json.loads(out[out.index("{") :])
    assert s["streamed"] is True and s["responses"] >= 16
    assert 0 < s["ttft_s"] < s["total_s"]
    # 15 tokens after the first, over the time between the first and the last token's responses.
    assert s["decode_tokens_per_s"] >= 15 / (s["total_s"] - s["ttft_s"])
    assert s["decode_tokens_per_s"] < 5 * s["tokens_per_s"], s
    code, out, err = client_summary(argv, capsys)
    line = err.strip().splitlines()[-1]
    assert "TTFT " in line and "(decode " in line and "not streamed" not in line, line


@pytest.mark.unit
def test_result_decode_rate_needs_two_timed_responses():
    """A decode rate needs tokens after the first response and time between responses; a single response
    (no streaming, or a stream whose tokens all came at once) has neither."""

    def chunk(n, t):
        return Chunk(text="x" * n, exit_depths=[4] * n, num_output_tokens=n, time=t)

    one = Result(chunks=[chunk(8, 1.0)], start=0.0, end=1.001)
    assert one.ttft == 1.0 and one.decode_tokens_per_s is None  # the old formula gave 7 / 0.001 s = 7000 tok/s
    not_streamed = Result(chunks=[chunk(8, 1.0)], start=0.0, end=1.001, streamed=False)
    assert not_streamed.ttft is None and not_streamed.decode_tokens_per_s is None
    assert not_streamed.summary()["tokens_per_s"] == pytest.approx(8 / 1.001)
    streamed = Result(chunks=[chunk(1, 0.2), chunk(3, 0.5), chunk(4, 1.0), chunk(0, 1.1)], start=0.0, end=1.1)
    assert streamed.ttft == 0.2 and streamed.decode_tokens_per_s == pytest.approx(7 / 0.8)


def test_load_generator_default_processes():
    """One client process per 16 workers, never more than half the cores (the server shares the host)."""
    from client.load import default_processes

    assert [default_processes(c, cores=16) for c in (1, 16, 17, 64, 256, 1024)] == [1, 1, 2, 4, 8, 8]
    assert default_processes(256, cores=2) == 1 and default_processes(4, cores=1) == 1
