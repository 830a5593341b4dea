"""Every device of a server (ouro_backend.serving.engine_pool), without Triton: which devices `engine_devices`
names, what each engine process sees, the manifest clients find the engines by, and a pool of two engine
processes on the toy checkpoint: requests spread over both with the offline engine's tokens, and a killed
engine comes back while the other serves on. Routing and per-engine streams: tests/test_streams.py; the
same through a real tritonserver: tests/test_server_engines.py."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from helpers import find_engine_process

from ouro_backend import LLM, SamplingParams
from ouro_backend.config import ConfigError, EngineConfig
from ouro_backend.serving import engine_auth
from ouro_backend.serving.engine_errors import EngineProcessError
from ouro_backend.serving.engine_messages import Outputs
from ouro_backend.serving.engine_pool import (
    EnginePool,
    EngineRouter,
    EngineSlot,
    engine_placement,
    read_manifest,
    resolve_devices,
    visible_gpus,
    write_manifest,
)

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize(
    "spec, device, gpus, expected",
    [
        ("auto", "auto", [], ["cpu"]),
        ("auto", "auto", ["0", "1"], ["cuda:0", "cuda:1"]),
        ("auto", "cuda", ["3"], ["cuda:0"]),
        ("auto", "cpu", ["0", "1"], ["cpu"]),
        ("auto", "cuda:1", ["0", "1"], ["cuda:1"]),
        ("cuda:1,cuda:0", "auto", ["0", "1"], ["cuda:1", "cuda:0"]),
        ("cpu, cpu", "auto", [], ["cpu", "cpu"]),
    ],
)
def test_resolve_devices(spec, device, gpus, expected):
    assert resolve_devices(spec, device, gpus) == expected


@pytest.mark.parametrize(
    "spec, device, gpus, match",
    [
        ("auto", "cuda", [], "no GPU is visible"),
        ("cuda:2", "auto", ["0", "1"], "cuda:2 is not visible"),
        ("auto", "cuda:1", ["0"], "cuda:1 is not visible"),
        ("gpu0", "auto", ["0"], "'gpu0' is not a device"),
        ("cuda:0,,cuda:1", "auto", ["0", "1"], "'' is not a device"),
    ],
)
def test_bad_devices_are_refused(spec, device, gpus, match):
    with pytest.raises(ConfigError, match=match):
        resolve_devices(spec, device, gpus)


def test_visible_gpus_follow_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,GPU-abc,-1,3")
    assert visible_gpus() == ["2", "GPU-abc"]  # CUDA ignores what follows an invalid entry
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpus() == []


def test_each_gpu_engine_sees_only_its_gpu():
    config = EngineConfig(model="m", device="auto")
    cfg, env = engine_placement("cuda:1", config, ["4", "7"])
    assert (cfg.device, env) == ("cuda:0", {"CUDA_VISIBLE_DEVICES": "7"})
    cfg, env = engine_placement("cpu", config, ["4"])
    assert (cfg.device, env) == ("cpu", {})
    # two engines on one GPU: the second sizes its KV after the first, up to the whole utilization
    shares = [engine_placement("cuda:0", config, ["0"], nth, 2)[0].gpu_memory_utilization for nth in (0, 1)]
    assert shares == pytest.approx([config.gpu_memory_utilization / 2, config.gpu_memory_utilization])


def test_manifest_must_be_private(tmp_path, monkeypatch):
    monkeypatch.setattr(engine_auth.tempfile, "gettempdir", lambda: str(tmp_path))
    slots = [EngineSlot(0, "/x/a.sock", "cuda:0"), EngineSlot(1, "/x/b.sock", "cuda:1")]
    write_manifest("eng", 42, slots)
    assert read_manifest("eng", 42) == slots
    path = tmp_path / f"ouro-triton-{os.getuid()}" / "engine-42-eng.json"
    os.chmod(path, 0o644)
    with pytest.raises(EngineProcessError, match="not private"):
        read_manifest("eng", 42)
    with pytest.raises(OSError):
        read_manifest("other", 42)


class Collector:
    """What a pool's engines send, per request."""

    def __init__(self):
        self.lock = threading.Lock()
        self.tokens: dict[str, list] = {}
        self.done: dict[str, str] = {}
        self.engine_of: dict[str, int] = {}
        self.closed: list[int] = []

    def on_message(self, index, msg):
        if not isinstance(msg, Outputs):
            return
        with self.lock:
            for d in msg.deltas:
                self.tokens.setdefault(d.rid, []).extend(d.ids)
                self.engine_of[d.rid] = index
                if d.finish_reason is not None:
                    self.done[d.rid] = d.finish_reason

    def wait(self, rids, timeout=120.0):
        deadline = time.monotonic() + timeout
        while not set(rids) <= set(self.done):
            assert time.monotonic() < deadline, f"timed out; done: {sorted(self.done)}"
            time.sleep(0.02)


def test_two_engines_share_the_requests_and_a_killed_one_comes_back(toy_path):
    prompts = [[5 + i, 6, 7 + i % 3, 8] for i in range(8)]
    ref = LLM(toy_path, device="cpu", dtype="float32").generate(prompts, GREEDY)
    got = Collector()
    logs: list = []
    config = EngineConfig(model=toy_path, device="cpu", dtype="float32", max_num_seqs=8)
    pool = EnginePool(
        "pool-test",
        os.getpid(),
        config,
        ["cpu", "cpu"],
        0.1,
        got.on_message,
        got.closed.append,
        lambda level, text: logs.append((level, text)),
    )
    pool.start()
    try:
        assert [s.device for s in read_manifest("pool-test", os.getpid())] == ["cpu", "cpu"]
        router = EngineRouter(2)
        for i, c in enumerate(pool.clients):
            router.set_client(i, c)
        for k, p in enumerate(prompts):
            i, client = router.pick()
            client.add(f"r{k}", p, GREEDY)
        got.wait([f"r{k}" for k in range(8)])
        assert [got.tokens[f"r{k}"] for k in range(8)] == [o.token_ids for o in ref]
        assert sorted(got.engine_of.values()) == [0] * 4 + [1] * 4

        old = pool.processes[1].pid
        os.kill(old, signal.SIGKILL)
        pool.clients[0].add("alive", prompts[0], GREEDY)  # the other engine serves on meanwhile
        got.wait(["alive"])
        assert got.tokens["alive"] == ref[0].token_ids and got.closed == [1]
        deadline = time.monotonic() + 60
        while pool.clients[1].closed or pool.processes[1].pid == old:
            assert time.monotonic() < deadline, f"engine 1 did not come back: {logs}"
            time.sleep(0.1)
        pool.clients[1].add("back", prompts[1], GREEDY)
        got.wait(["back"])
        assert got.tokens["back"] == ref[1].token_ids and got.engine_of["back"] == 1
        assert any("engine 1 (cpu): engine process" in text and "ready" in text for _, text in logs)
    finally:
        pool.close()
    assert all(p.poll() is not None for p in pool.processes)
    with pytest.raises(OSError):
        read_manifest("pool-test", os.getpid())


def test_a_bad_checkpoint_fails_the_pool_and_leaves_no_engine(tmp_path):
    config = EngineConfig(model=str(tmp_path), device="cpu")
    pool = EnginePool(
        "bad-pool",
        os.getpid(),
        config,
        ["cpu", "cpu"],
        0.1,
        lambda i, m: None,
        lambda i: None,
        lambda level, text: None,
    )
    with pytest.raises(ConfigError, match="config.json"):
        pool.start()
    assert all(p is None or p.poll() is not None for p in pool.processes)


def test_an_engine_killed_while_it_restarts_is_restarted_again(toy_path, monkeypatch):
    monkeypatch.setattr(EnginePool, "RESTART_BACKOFF_S", (0.2, 1.0))
    ref = LLM(toy_path, device="cpu", dtype="float32").generate([[5, 6, 7, 8]], GREEDY)[0]
    got = Collector()
    logs: list = []
    config = EngineConfig(model=toy_path, device="cpu", dtype="float32", max_num_seqs=4)
    pool = EnginePool(
        "pool-restart",
        os.getpid(),
        config,
        ["cpu"],
        0.1,
        got.on_message,
        got.closed.append,
        lambda level, text: logs.append((level, text)),
    )
    pool.start()
    try:
        first = pool.processes[0].pid
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while not (second := find_engine_process(pool.slots[0].address, {first})):  # still loading
            assert time.monotonic() < deadline, f"no new engine process was started: {logs}"
            time.sleep(0.01)
        os.kill(second, signal.SIGKILL)  # before it is ready
        while pool.clients[0].closed or pool.processes[0].pid in (first, second):
            assert time.monotonic() < deadline, f"engine 0 did not come back: {logs}"
            time.sleep(0.1)
        pool.clients[0].add("back", [5, 6, 7, 8], GREEDY)
        got.wait(["back"])
        assert got.tokens["back"] == ref.token_ids
        assert any("restart attempt 1 failed" in text for _, text in logs), logs
        assert pool.restarts == [1]
    finally:
        pool.close()
