"""Engine processes and model loading through a real tritonserver (several of their own): an engine that dies, the
request trace of every hop, one engine per device, bad options that fail the model load, and the
launcher refusing bad arguments.

The shared server is conftest.py's session fixture `server`; the helpers are in server_common.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers import wait_for
from server_common import DEVICE, ENGINE_ARGS, PROMPT, PROMPTS, ROOT, START_TIMEOUT_S, offline, server_or_skip

from client.ouro_client import GrpcStream, generate, request_options
from ouro_backend.entrypoints.tritonserver import ServerError

pytestmark = pytest.mark.timeout(300)


# ------------------------------------------------------------------------------------------- load failures


def test_engine_process_death_ends_requests_with_errors(toy_path, llm):
    """If the engine process dies, open requests end with an error (none hangs), the server keeps serving,
    a new engine process takes over (the front reconnects) and shutdown is clean."""
    import signal

    srv = server_or_skip(model=toy_path, engine_args=ENGINE_ARGS, address="127.0.0.1")  # this host only
    srv.start(timeout=START_TIMEOUT_S)
    try:
        pid = int(re.search(r"engine 0 ready on \S+ \(process (\d+)\)", srv.log_text()).group(1))
        opts = request_options(max_tokens=1500, ignore_eos=True, temperature=0.0, stream=True)
        models = ("ouro", "ouro_ensemble")
        started = {m: threading.Event() for m in models}
        results = {}

        def run(model):
            results[model] = generate(
                srv.grpc_url, model, PROMPT, opts, timeout=60, on_chunk=lambda c: started[model].set()
            )

        threads = [threading.Thread(target=run, args=(m,)) for m in models]
        for t in threads:
            t.start()
        for m in models:
            assert started[m].wait(timeout=60), f"{m} did not start streaming"
        os.kill(pid, signal.SIGKILL)
        for t in threads:
            t.join(timeout=60)
        for model in models:
            assert "the engine process exited" in (results[model].error or ""), (model, results[model].error)
        assert urllib.request.urlopen(f"http://{srv.http_url}/v2/health/live", timeout=10).status == 200
        ref = offline(llm, PROMPT, max_tokens=8, temperature=0.0)
        short = request_options(max_tokens=8, temperature=0.0, stream=True)

        def served_again():
            r = generate(srv.grpc_url, "ouro", PROMPT, short, timeout=60)
            assert r.end - r.start < 10, "a request refused while the engine restarts does not wait"
            return r.error is None and r

        again = wait_for(served_again, timeout=120, interval=0.5)
        assert again and again.text == ref.text
        new_pid = int(re.findall(r"engine process (\d+) ready", srv.log_text())[-1])
        assert new_pid != pid
    finally:
        code = srv.stop()
    assert code == 0, srv.log_tail()


def test_request_trace_times_every_hop(toy_path, llm, tmp_path):
    """OURO_REQUEST_TRACE: each streamed request is seen at every hop (client, front, engine process, front,
    client), in order, joined through the request id the client sent."""
    from ouro_backend.serving import request_trace

    trace_dir = tmp_path / "hops"
    srv = server_or_skip(
        model=toy_path, engine_args=ENGINE_ARGS, address="127.0.0.1", env={request_trace.ENV: str(trace_dir)}
    )
    srv.start(timeout=START_TIMEOUT_S)
    client_trace = request_trace.RequestTrace(str(trace_dir), "client")
    try:
        opts = request_options(max_tokens=8, temperature=0.0, stream=True)

        def one(prompt):
            stream = GrpcStream(srv.grpc_url, trace=client_trace)
            try:
                return generate(srv.grpc_url, "ouro", prompt, opts, timeout=60, grpc_stream=stream)
            finally:
                stream.close()

        with ThreadPoolExecutor(4) as ex:
            got = list(ex.map(one, PROMPTS[:4]))
        assert [r.error for r in got] == [None] * 4
    finally:
        code = srv.stop()
    assert code == 0, srv.log_tail()
    client_trace.write()
    summary = request_trace.summarize(str(trace_dir))
    assert summary["requests"] == 4, (summary, sorted(os.listdir(trace_dir)))
    hops = {k: v for k, v in summary.items() if " -> " in k}
    assert len(hops) == len(request_trace.HOPS) - 1
    # The events come in the documented order; the client may have a response before the front's send()
    # returns, so the last hop alone can be negative.
    assert all(v["median_ms"] >= 0 for k, v in hops.items() if k != "front.responded -> client.received"), hops
    assert summary["ttft_ms"]["median_ms"] > 0


def engine_tokens(server) -> dict[str, float]:
    """ouro_generation_tokens_total of each engine process (label `engine`)."""
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    out: dict[str, float] = {}
    for labels, value in re.findall(r"^ouro_generation_tokens_total\{([^}]*)\} (\S+)$", text, re.M):
        engine = re.search(r'engine="(\d+)"', labels).group(1)
        out[engine] = out.get(engine, 0.0) + float(value)
    return out


def test_every_device_serves_and_a_killed_engine_comes_back(toy_path, llm):
    """engine_devices=cpu,cpu (what `auto` makes of two GPUs, here on the CPU): requests through both models
    spread over the two engine processes with the offline engine's text, each engine has its own metrics
    series, and a killed engine leaves the other serving and is back within a minute."""
    import signal

    srv = server_or_skip(
        model=toy_path,
        engine_args=ENGINE_ARGS,
        address="127.0.0.1",
        devices=f"{DEVICE},{DEVICE}" if DEVICE == "cpu" else "cuda:0,cuda:0",
    )
    srv.start(timeout=START_TIMEOUT_S)
    try:
        pids = {int(i): int(p) for i, p in re.findall(r"engine (\d) ready on \S+ \(process (\d+)\)", srv.log_text())}
        assert sorted(pids) == [0, 1], srv.log_tail()
        opts = request_options(max_tokens=16, temperature=0.0, stream=True)
        ref = {p: offline(llm, p, max_tokens=16, temperature=0.0).text for p in PROMPTS}
        work = [(m, p) for m in ("ouro", "ouro_ensemble") for p in PROMPTS]

        def serve_all():
            with ThreadPoolExecutor(8) as ex:
                got = list(ex.map(lambda mp: generate(srv.grpc_url, mp[0], mp[1], opts, timeout=60), work))
            assert [(r.error, r.text) for r in got] == [(None, ref[p]) for _, p in work]

        serve_all()
        assert wait_for(lambda: (c := engine_tokens(srv)) and c.get("0", 0) > 0 and c.get("1", 0) > 0), (
            f"both engines take requests: {engine_tokens(srv)}"
        )

        os.kill(pids[1], signal.SIGKILL)
        assert wait_for(lambda: "engine 1 (" in srv.log_text() and "exited with code" in srv.log_text(), timeout=30)
        serve_all()  # the other engine serves on (and engine 1 once it is back)
        back = wait_for(lambda: re.findall(r"engine 1 \(\S+\): engine process (\d+) ready", srv.log_text()), timeout=60)
        assert back and int(back[-1]) != pids[1], "engine 1 was not restarted within a minute"
        before = engine_tokens(srv).get("1", 0)
        time.sleep(1.0)  # the front retries a lost engine at most once a second
        serve_all()
        assert wait_for(lambda: engine_tokens(srv).get("1", 0) > before), "the restarted engine gets requests again"
    finally:
        code = srv.stop()
    assert code == 0, srv.log_tail()
    assert "Traceback" not in srv.log_text()


@pytest.mark.parametrize(
    "model, message",
    [
        ("ouro_engine", "ouro_engine: invalid engine configuration: unknown engine option 'bogus_option'"),
        ("ouro", "ouro: unknown parameter 'bogus_option'"),
    ],
)
def test_bad_option_fails_model_load(tmp_path, model, message):
    """A bad `parameters` entry in a model's config.pbtxt fails its load with a readable message."""
    repo = tmp_path / "repo"
    (repo / model / "1").mkdir(parents=True)
    os.symlink(os.path.join(ROOT, "model_repository", model, "1", "model.py"), repo / model / "1" / "model.py")
    config = open(os.path.join(ROOT, "model_repository", model, "config.pbtxt")).read()
    config += 'parameters { key: "bogus_option" value: { string_value: "1" } }\n'
    (repo / model / "config.pbtxt").write_text(config)
    srv = server_or_skip(model_repository=str(repo))
    try:
        with pytest.raises(ServerError, match="exited"):
            srv.start(timeout=120)
    finally:
        srv.stop()
    log = srv.log_text()
    assert f"failed to load '{model}'" in log
    assert message in log, srv.log_tail()


def test_launcher_rejects_bad_engine_arg():
    r = subprocess.run(
        [sys.executable, "-m", "ouro_backend.entrypoints.serve", "--engine-arg", "max_num_seqs=-1", "--http-port", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "bad --engine-arg: max_num_seqs must be a positive integer" in r.stderr, r.stderr


def test_launcher_takes_serving_keys_as_engine_args_and_checks_them():
    """stream_interval is the serving layer's (both decoupled models'), not an engine option: a good value is
    accepted as an --engine-arg (an engine option after it is then what is refused), and a bad value is
    refused before anything starts, naming it."""
    cmd = [sys.executable, "-m", "ouro_backend.entrypoints.serve", "--http-port", "1"]
    r = subprocess.run(
        cmd + ["--engine-arg", "stream_interval=-1"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 2 and "bad --engine-arg: stream_interval=-1 must be >= 0" in r.stderr, r.stderr
    r = subprocess.run(
        cmd + ["--engine-arg", "stream_interval=1", "--engine-arg", "max_num_seqs=-1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    # past stream_interval: the engine option after it is what is refused
    assert r.returncode == 2 and "bad --engine-arg: max_num_seqs must be a positive integer" in r.stderr, r.stderr


def test_launcher_rejects_bad_devices():
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "ouro_backend.entrypoints.serve",
            "--devices",
            "cuda:7",
            "--engine-arg",
            "device=cpu",
            "--http-port",
            "1",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, CUDA_VISIBLE_DEVICES="0"),
    )
    assert (
        r.returncode == 2
        and "bad --devices: engine_devices='cuda:7': cuda:7 is not visible (1 GPU(s) visible)" in r.stderr
    ), r.stderr
