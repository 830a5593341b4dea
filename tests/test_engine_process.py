"""The engine process (ouro_backend.serving.engine_server, through engine_client) on the toy checkpoint,
without Triton: the owner channel and a second client over the Unix socket get the same tokens as the
in-process engine; bad requests, aborts, a client that goes away, a bad config and a killed child are all
reported."""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter

import pytest
from helpers import Inbox

from ouro_backend import LLM, SamplingParams
from ouro_backend.config import ConfigError, EngineConfig
from ouro_backend.engine import round_trace
from ouro_backend.engine.round_trace import summarize
from ouro_backend.serving.engine_auth import engine_address, key_path
from ouro_backend.serving.engine_client import EngineClient, start_engine_process
from ouro_backend.serving.engine_errors import EngineProcessError
from ouro_backend.serving.engine_messages import AddRequest

GREEDY = dict(max_tokens=12, temperature=0.0, ignore_eos=True)
LONG = 1000  # tokens: far more than a test waits for, within the toy's context


@pytest.fixture(scope="module")
def engine(toy_path):
    inbox = Inbox()
    config = EngineConfig(model=toy_path, device="cpu", dtype="float32", max_num_seqs=8)
    address = engine_address("test-engine", os.getpid())
    client, proc = start_engine_process(config, address, inbox.on_message, inbox.on_close, metrics_interval_s=0.1)
    yield client, proc, inbox, address
    client.close()
    proc.wait(timeout=30)
    assert not os.path.exists(address), "the engine process leaves no socket behind"


def test_owner_and_socket_client_match_offline_engine(engine, toy_path):
    client, _, inbox, address = engine
    other = Inbox()
    second = EngineClient.connect(address, other.on_message, other.on_close)
    try:
        prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
        params = SamplingParams(**GREEDY, exit_threshold=0.7)
        for i, p in enumerate(prompts):
            (client if i % 2 == 0 else second).add(f"r{i}", p, params)
        inbox.pump(lambda: {"r0", "r2"} <= set(inbox.reasons))
        other.pump(lambda: "r1" in other.reasons)
        assert "r1" not in inbox.tokens and "r0" not in other.tokens, "each client gets only its own requests"
        ref = LLM(model=toy_path, device="cpu", dtype="float32").generate(prompts, params)
        got = [inbox.tokens["r0"], other.tokens["r1"], inbox.tokens["r2"]]
        assert got == [r.token_ids for r in ref]
        assert [inbox.depths["r0"], other.depths["r1"], inbox.depths["r2"]] == [r.exit_depths for r in ref]
        assert inbox.reasons["r0"] == "length"
        # Metrics go to the owner only, and count every client's requests.
        inbox.pump(lambda: sum(s.counters.get("generation_tokens", 0) for s in inbox.stats) >= 36)
        assert sum(s.finished.get("length", 0) for s in inbox.stats) >= 3
        # The token counters come from the engine's own counters (growth between snapshots).
        assert sum(s.counters.get("generation_tokens", 0) for s in inbox.stats) == 36
        assert sum(s.counters.get("prompt_tokens", 0) for s in inbox.stats) == sum(map(len, prompts))
        depths = sum((s.depths for s in inbox.stats), Counter())
        assert depths == Counter(d for r in ref for d in r.exit_depths), "one exit-depth count per token"
        assert not other.stats
    finally:
        second.close()
    assert other.closed


def test_rejected_request_and_abort(engine):
    client, _, inbox, _ = engine
    client.add("too-long", [5] * 10, SamplingParams(max_tokens=10**6))
    inbox.pump(lambda: "too-long" in inbox.rejected)
    assert "context limit" in inbox.rejected["too-long"]
    client.add("long", [5, 6], SamplingParams(max_tokens=LONG, ignore_eos=True, temperature=0.0))
    inbox.pump(lambda: len(inbox.tokens.get("long", [])) >= 2)
    client.abort("long")
    inbox.pump(lambda: "long" in inbox.reasons)
    assert inbox.reasons["long"] == "abort" and len(inbox.tokens["long"]) < LONG
    inbox.pump(
        lambda: (
            inbox.stats
            and inbox.stats[-1].stats
            and inbox.stats[-1].stats["num_running"] == 0
            and inbox.stats[-1].stats["kv_usage"] == 0
        )
    )


def test_request_id_in_use_by_another_client_is_refused(engine):
    client, _, inbox, address = engine
    other = Inbox()
    second = EngineClient.connect(address, other.on_message, other.on_close)
    try:
        client.add("shared-id", [5, 6], SamplingParams(max_tokens=LONG, ignore_eos=True, temperature=0.0))
        inbox.pump(lambda: "shared-id" in inbox.tokens)
        second.add("shared-id", [7, 8], SamplingParams(max_tokens=4))
        other.pump(lambda: "shared-id" in other.rejected)
        assert "already in use" in other.rejected["shared-id"]
        second.abort("shared-id")  # not the second client's request: it goes on
        n = len(inbox.tokens["shared-id"])
        inbox.pump(lambda: len(inbox.tokens["shared-id"]) > n + 2)  # the first request still streams
        assert "shared-id" not in inbox.reasons
        client.abort("shared-id")
        inbox.pump(lambda: "shared-id" in inbox.reasons)
    finally:
        second.close()


def test_client_that_goes_away_frees_its_requests(engine):
    _, _, inbox, address = engine
    other = Inbox()
    second = EngineClient.connect(address, other.on_message, other.on_close)
    second.add("orphan", [5, 6, 7], SamplingParams(max_tokens=LONG, ignore_eos=True, temperature=0.0))
    other.pump(lambda: "orphan" in other.tokens)
    second.close()
    inbox.stats.clear()
    inbox.pump(lambda: any(s.finished.get("cancelled") for s in inbox.stats))
    inbox.pump(
        lambda: (
            inbox.stats[-1].stats
            and inbox.stats[-1].stats["num_running"] == 0
            and inbox.stats[-1].stats["kv_usage"] == 0
        )
    )


def test_client_without_the_key_is_rejected_and_the_server_keeps_serving(engine):
    """Nothing a peer sends is unpickled before it proves it holds the engine's key: a client without the
    key, one with a wrong key and one that says nothing are all cut off; the rest carry on."""
    from multiprocessing import AuthenticationError
    from multiprocessing.connection import Client

    client, _, inbox, address = engine
    assert os.stat(address + ".key").st_mode & 0o777 == 0o600
    silent = Client(address, family="AF_UNIX")  # connects, never answers the challenge
    with pytest.raises(AuthenticationError):
        Client(address, family="AF_UNIX", authkey=b"not the key")
    raw = Client(address, family="AF_UNIX")  # no key: its message is taken as the challenge's answer
    raw.send(AddRequest("sneaky", [5, 6], SamplingParams(**GREEDY)))
    got = []
    with pytest.raises((EOFError, OSError)):
        for _ in range(10):
            got.append(raw.recv_bytes())
    assert not any(b"Hello" in m for m in got)
    # The server still serves: a client with the key connects and runs a request with the same id.
    other = Inbox()
    second = EngineClient.connect(address, other.on_message, other.on_close)
    try:
        second.add("sneaky", [5, 6], SamplingParams(**GREEDY))
        other.pump(lambda: "sneaky" in other.reasons)
        assert other.reasons["sneaky"] == "length" and len(other.tokens["sneaky"]) == GREEDY["max_tokens"]
    finally:
        second.close()
    silent.close()


def test_foreign_or_open_socket_directory_is_refused(monkeypatch, tmp_path):
    from ouro_backend.serving import engine_auth

    monkeypatch.setattr(engine_auth.tempfile, "gettempdir", lambda: str(tmp_path))
    directory = tmp_path / f"ouro-triton-{os.getuid()}"
    assert engine_address("m", 1).startswith(str(directory))  # created, 0700
    assert directory.stat().st_mode & 0o777 == 0o700
    directory.chmod(0o777)
    with pytest.raises(EngineProcessError, match="accessible by other users"):
        engine_address("m", 1)
    directory.chmod(0o700)
    if os.getuid() == 0:  # only root can give it away
        os.chown(directory, 65534, 65534)
        with pytest.raises(EngineProcessError, match="belongs to uid 65534"):
            engine_address("m", 1)
    directory.rmdir()
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    directory.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(EngineProcessError, match="not a directory"):
        engine_address("m", 1)


def test_no_engine_at_address():
    with pytest.raises(EngineProcessError, match="no engine process"):
        EngineClient.connect(engine_address("nobody", 1), print, print, timeout_s=0.3)


def test_bad_checkpoint_fails_start_with_its_message(tmp_path):
    config = EngineConfig(model=str(tmp_path), device="cpu")
    with pytest.raises(ConfigError, match="config.json"):
        start_engine_process(config, engine_address("bad", os.getpid()), print, print)


def test_engine_process_exits_when_its_owner_is_killed(toy_path, tmp_path):
    """The owner channel's end closes when the owner dies, even by SIGKILL: the engine must not outlive it."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from ouro_backend.config import EngineConfig\n"
        "from ouro_backend.serving.engine_auth import engine_address\n"
        "from ouro_backend.serving.engine_client import start_engine_process\n"
        f"config = EngineConfig(model={toy_path!r}, device='cpu', dtype='float32', max_num_seqs=2)\n"
        "client, proc = start_engine_process(config, engine_address('orphan', 0), lambda m: None, lambda: None)\n"
        "print(proc.pid, flush=True)\n"
        "sys.stdin.read()\n"
    )
    owner = subprocess.Popen(
        [sys.executable, "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    try:
        child = int(owner.stdout.readline())
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)
        os.kill(child, signal.SIGKILL)
        pytest.fail("the engine process outlived its owner")
    finally:
        owner.kill()


def test_killed_engine_process_is_reported(toy_path):
    inbox = Inbox()
    config = EngineConfig(model=toy_path, device="cpu", dtype="float32", max_num_seqs=2)
    address = engine_address("killed", os.getpid())
    client, proc = start_engine_process(config, address, inbox.on_message, inbox.on_close)
    try:
        client.add("x", [5, 6], SamplingParams(max_tokens=LONG, ignore_eos=True, temperature=0.0))
        inbox.pump(lambda: "x" in inbox.tokens)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 10
        while not inbox.closed and time.monotonic() < deadline:
            time.sleep(0.05)
        assert inbox.closed
        with pytest.raises(EngineProcessError, match="gone"):
            client.add("y", [5], SamplingParams())
    finally:  # a killed engine cannot remove its socket and key (ouro-serve's supervisor does, for a server)
        for path in (address, key_path(address)):
            if os.path.lexists(path):
                os.unlink(path)


def test_overlap_hook_runs_every_launch_and_changes_nothing(toy_path):
    """The engine process sends outputs from ModelRunner.overlap; the hook must run once per launch."""
    llm = LLM(model=toy_path, device="cpu", dtype="float32")
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    params = SamplingParams(**GREEDY, exit_threshold=0.7)
    ref = llm.generate(prompts, params)
    runner = llm.engine.runner
    launches_before = runner.stats.launches
    calls = []
    runner.overlap = lambda: calls.append(1)
    got = llm.generate(prompts, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    assert [r.exit_depths for r in got] == [r.exit_depths for r in ref]
    assert len(calls) == runner.stats.launches - launches_before > 0


def test_round_trace(toy_path, tmp_path, monkeypatch):
    """OURO_ENGINE_TRACE: every step of the engine process that ran a round, written when it stops."""
    path = tmp_path / "trace.json"
    monkeypatch.setenv(round_trace.ENV, str(path))
    inbox = Inbox()
    config = EngineConfig(model=toy_path, device="cpu", dtype="float32", max_num_seqs=8)
    client, proc = start_engine_process(config, str(tmp_path / "engine.sock"), inbox.on_message, inbox.on_close)
    try:
        for i in range(2):
            client.add(f"t{i}", [5, 6, 7, 8], SamplingParams(**GREEDY))
        inbox.pump(lambda: {"t0", "t1"} <= set(inbox.reasons))
    finally:
        client.close()
        proc.wait(timeout=30)
    trace = json.loads(path.read_text())
    col = {name: i for i, name in enumerate(trace["columns"])}
    rows = trace["rows"]
    assert sum(r[col["emitted"]] for r in rows) == 2 * GREEDY["max_tokens"]
    assert sum(r[col["prefill_tokens"]] for r in rows) == 2 * 4 * 4  # two 4-token prompts, 4 loops each
    assert all(r[col["step_s"]] > 0 for r in rows)
    summary = summarize(str(path))
    assert summary["steps"] == len(rows) and summary["prefill_steps"] >= 4
    assert 0 < summary["mean_running"] <= 2


def test_first_tokens_go_out_at_once_and_nothing_is_kept():
    """A step's outputs that carry a request's first token are sent as soon as the step returns, the others
    during the next step; a finished request leaves nothing behind."""
    from ouro_backend.outputs import RequestOutput
    from ouro_backend.serving.engine_server import FirstTokens

    def out(rid, ids, finished=False):
        return RequestOutput(rid, [1], [], [], [], "", finished=finished, new_token_ids=ids)

    first = FirstTokens()
    a1, b0 = out("a", [5]), out("b", [])  # b: no token yet (its prompt is still being prefilled)
    assert first.split([a1, b0]) == ([a1], [b0])
    first.sent([a1, b0])
    a2, b1, c1 = out("a", [6]), out("b", [7]), out("c", [8, 9], finished=True)  # c: one launch, done
    assert first.split([a2, b1, c1]) == ([b1, c1], [a2])
    first.sent([b1, c1])
    first.sent([a2])
    first.sent([out("a", [], finished=True), out("b", [10], finished=True)])
    assert first.started == set()


def test_stand_in_runner_gives_every_request_its_tokens(toy_path):
    """benchmarks/served.py --stand-in: the engine process with the model runner replaced
    (OURO_ENGINE_RUNNER, benchmarks/stand_in_engine.py) streams each request exactly max_tokens tokens at
    full depth, finished by the length rule, and aborts still end requests."""
    from ouro_backend.serving.engine_server import RUNNER_ENV

    inbox = Inbox()
    config = EngineConfig(model=toy_path, device="cpu", dtype="float32", max_num_seqs=4)
    env = {RUNNER_ENV: "benchmarks.stand_in_engine:StandInRunner"}  # the child's PYTHONPATH holds this checkout
    client, proc = start_engine_process(
        config, engine_address("stand-in", os.getpid()), inbox.on_message, inbox.on_close, env=env
    )
    try:
        lengths = {f"r{i}": n for i, n in enumerate([1, 5, 17, 40, 3, 8])}  # more requests than slots
        for rid, n in lengths.items():
            client.add(rid, [5, 6, 7, 8 + len(rid)], SamplingParams(max_tokens=n, temperature=0.0))
        client.add("gone", [9, 9, 9], SamplingParams(max_tokens=LONG, temperature=0.0))
        inbox.pump(lambda: set(lengths) <= set(inbox.reasons) and len(inbox.tokens.get("gone", [])) >= 2)
        client.abort("gone")
        inbox.pump(lambda: "gone" in inbox.reasons)
        assert {rid: len(inbox.tokens[rid]) for rid in lengths} == lengths
        assert all(inbox.reasons[rid] == "length" for rid in lengths) and inbox.reasons["gone"] == "abort"
        assert all(set(inbox.depths[rid]) == {4} for rid in lengths)
    finally:
        client.close()
        proc.wait(timeout=30)
