"""Every device of a server: one engine process per device, and the way a client picks one for each request.

An `ouro_engine` model owns an `EnginePool`: `engine_devices` (default `auto`: every visible GPU, else one
engine on the CPU) says how many engine processes it starts and where. Each process sees only its own GPU
(`CUDA_VISIBLE_DEVICES` narrowed to it), so an engine never touches another's device. They start in
parallel, and each is restarted on its own when it dies; the others serve on meanwhile.

The pool leaves a manifest (`engine-<server pid>-<model>.json` in the engine sockets' private directory)
naming each engine's socket and device. Clients (the `ouro` front, and `ouro_engine` for its own requests)
hold an `EngineRouter`: a connection to each engine and the load it knows of, and they send every new
request to the least loaded engine: the fewest requests (running + waiting, its own ones counted at once,
the other clients' ones as the engine last reported them), then the least KV in use.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from ..config import ConfigError, EngineConfig
from .engine_auth import engine_address, private_dir
from .engine_client import EngineClient, start_engine_process
from .engine_errors import EngineProcessError, ServerBusy
from .engine_messages import FromEngine, Load


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them (ids or UUIDs), else their indices."""
    raw = os.environ.get("CUDA_VISIBLE_DEVICES")
    if raw is not None:
        ids = [d.strip() for d in raw.split(",") if d.strip()]
        # CUDA stops at the first invalid entry ("-1" hides every GPU).
        return ids[: next((i for i, d in enumerate(ids) if d.startswith("-")), len(ids))]
    try:
        import torch

        return [str(i) for i in range(torch.cuda.device_count())]
    except Exception:  # no torch or no driver: no GPU
        return []


def resolve_devices(spec: str, device: str = "auto", gpus: list[str] | None = None) -> list[str]:
    """`engine_devices` -> one device per engine: `cpu` or `cuda:<i>` (i-th visible GPU).

    auto: the engine option `device` decides: auto or cuda -> every visible GPU (auto without one: the CPU);
    an explicit device (cpu, cuda:N) -> that one engine. Otherwise a comma-separated list such as
    `cuda:0,cuda:1` or `cpu,cpu` (a device may repeat: its engines share it)."""
    gpus = visible_gpus() if gpus is None else gpus
    spec = (spec or "auto").strip()
    if spec == "auto" and device in ("auto", "cuda"):
        if gpus:
            return [f"cuda:{i}" for i in range(len(gpus))]
        if device == "cuda":
            raise ConfigError(
                "device=cuda but no GPU is visible (CUDA_VISIBLE_DEVICES="
                f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')})"
            )
        return ["cpu"]
    devices = [d.strip() for d in (device if spec == "auto" else spec).split(",")]
    for d in devices:
        if d == "cpu":
            continue
        index = d[5:] if d.startswith("cuda:") else ""
        if not index.isdigit():
            raise ConfigError(
                f"engine_devices={spec!r}: {d!r} is not a device (use cpu or cuda:N, comma-separated, or auto)"
            )
        if int(index) >= len(gpus):
            raise ConfigError(f"engine_devices={spec!r}: {d} is not visible ({len(gpus)} GPU(s) visible)")
    return devices


def engine_placement(
    device: str, config: EngineConfig, gpus: list[str], nth: int = 0, of: int = 1
) -> tuple[EngineConfig, dict[str, str]]:
    """The engine config and environment of the `nth` of `of` engine processes on `device`: a GPU engine
    sees only its GPU. Engines sharing a GPU start one after another, and automatic KV sizing counts the
    memory of those before as taken: the nth may fill the GPU up to (nth + 1) / of of
    `gpu_memory_utilization`, so each gets an equal share."""
    if device == "cpu":
        return replace(config, device="cpu"), {}
    gpu = gpus[int(device.split(":")[1])]
    share = config.gpu_memory_utilization * (nth + 1) / of
    return replace(config, device="cuda:0", gpu_memory_utilization=share), {"CUDA_VISIBLE_DEVICES": gpu}


def manifest_path(engine_model: str, server_pid: int) -> str:
    return os.path.join(private_dir(), f"engine-{server_pid}-{engine_model}.json")


@dataclass(frozen=True)
class EngineSlot:
    """Where engine `index` of a pool listens and what it runs on."""

    index: int
    address: str
    device: str


def write_manifest(engine_model: str, server_pid: int, slots: list[EngineSlot]) -> None:
    path = manifest_path(engine_model, server_pid)
    tmp = f"{path}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump([{"address": s.address, "device": s.device} for s in slots], f)
    os.replace(tmp, path)


def read_manifest(engine_model: str, server_pid: int) -> list[EngineSlot]:
    """The engines of `engine_model` in this server; OSError while there is no manifest yet."""
    path = manifest_path(engine_model, server_pid)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise EngineProcessError(f"{path} is not private to this user; refusing to use it")
        entries = json.load(f)
    return [EngineSlot(i, e["address"], e["device"]) for i, e in enumerate(entries)]


def remove_manifest(engine_model: str, server_pid: int) -> None:
    try:
        os.unlink(manifest_path(engine_model, server_pid))
    except OSError:
        pass


# ------------------------------------------------------------------------------------------------ owner
class EnginePool:
    """The engine processes of one `ouro_engine` model. `on_message(index, msg)` and `on_closed(index)`
    run on engine `index`'s reader thread; `log(level, text)` reports starts and restarts."""

    def __init__(
        self,
        engine_model: str,
        server_pid: int,
        config: EngineConfig,
        devices: list[str],
        metrics_interval_s: float,
        on_message: Callable[[int, FromEngine], None],
        on_closed: Callable[[int], None],
        log: Callable[[str, str], None],
    ):
        self.engine_model, self.server_pid = engine_model, server_pid
        self.config, self.metrics_interval_s = config, metrics_interval_s
        self._on_message, self._on_closed, self._log = on_message, on_closed, log
        self._gpus = visible_gpus()
        self.slots = [
            EngineSlot(i, engine_address(f"{engine_model}-{i}", server_pid), d) for i, d in enumerate(devices)
        ]
        self.clients: list[EngineClient | None] = [None] * len(devices)
        self.processes: list = [None] * len(devices)
        self.restarts = [0] * len(devices)
        self._unloading = False

    def start(self) -> None:
        """Start every engine (in parallel, except engines that share a device: one after another, so each
        sizes its KV cache from what the previous left free) and write the manifest. If one fails, the
        others are stopped and its error raised (ConfigError first: a bad config fails every engine alike)."""
        by_device: dict[str, list[EngineSlot]] = {}
        for slot in self.slots:
            by_device.setdefault(slot.device, []).append(slot)

        def start_group(slots: list[EngineSlot]) -> Exception | None:
            for slot in slots:
                try:
                    self._start(slot.index)
                except (ConfigError, EngineProcessError) as e:
                    return e
            return None

        with ThreadPoolExecutor(max_workers=len(by_device)) as ex:
            errors = [e for e in ex.map(start_group, by_device.values()) if e is not None]
        if errors:
            self.close()
            raise next((e for e in errors if isinstance(e, ConfigError)), errors[0])
        write_manifest(self.engine_model, self.server_pid, self.slots)

    def _start(self, index: int) -> None:
        slot = self.slots[index]
        same = [s.index for s in self.slots if s.device == slot.device]
        config, env = engine_placement(slot.device, self.config, self._gpus, same.index(index), len(same))
        previous = self.clients[index]
        if previous is not None:  # a restart: the KV cache it had (its neighbours on the device hold theirs)
            config = replace(config, num_blocks=previous.info.kv_blocks, kv_cache_bytes=None)
        client, proc = start_engine_process(
            config,
            slot.address,
            lambda msg: self._on_message(index, msg),
            lambda: self._closed(index),
            self.metrics_interval_s,
            env=env,
        )
        self.clients[index], self.processes[index] = client, proc

    def _closed(self, index: int) -> None:
        self._on_closed(index)
        if not self._unloading:
            threading.Thread(
                target=self._restart, args=(index,), name=f"ouro-engine-restart-{index}", daemon=True
            ).start()

    RESTART_BACKOFF_S = (1.0, 30.0)  # the first retry's wait, doubled after each failure up to the second

    def _restart(self, index: int) -> None:
        """Start engine `index` again, retrying with backoff until it serves or the model is unloaded.
        NOTE: a start that fails (the new process died too, or was killed while it loaded) is retried
        the same way: the device is never left without an engine while the model is loaded."""
        slot = self.slots[index]
        code = self.processes[index].wait()
        self._log(
            "error",
            f"engine {index} ({slot.device}): process {self.processes[index].pid} "
            f"exited with code {code}; starting a new one",
        )
        wait, attempt = self.RESTART_BACKOFF_S[0], 1
        while not self._unloading:
            try:
                self._start(index)
            except Exception as e:
                self._log(
                    "error",
                    f"engine {index} ({slot.device}): restart attempt {attempt} failed ({e}); retrying in {wait:.0f}s",
                )
                time.sleep(wait)
                wait, attempt = min(2 * wait, self.RESTART_BACKOFF_S[1]), attempt + 1
                continue
            self.restarts[index] += 1
            client = self.clients[index]
            assert client is not None  # _start() set it
            self._log(
                "info",
                f"engine {index} ({slot.device}): engine process {client.info.pid} "
                f"ready (restart {self.restarts[index]})",
            )
            return

    def close(self) -> None:
        """Stop every engine process (each exits when its owner channel closes)."""
        self._unloading = True
        remove_manifest(self.engine_model, self.server_pid)
        for client in self.clients:
            if client is not None:
                client.close()
        for proc in self.processes:
            if proc is None:
                continue
            try:
                proc.wait(timeout=30)
            except Exception:
                proc.kill()


# ------------------------------------------------------------------------------------------------ clients
class EngineRouter:
    """One client's view of a pool: a connection per engine (`connect(index)` makes one) and each engine's
    load. Thread-safe."""

    RECONNECT_INTERVAL_S = 1.0  # a lost engine is retried at most this often, so requests do not wait on it

    def __init__(self, num_engines: int, connect: Callable[[int], EngineClient] | None = None):
        self._connect = connect
        self._lock = threading.Lock()
        self.clients: list[EngineClient | None] = [None] * num_engines
        self._mine = [0] * num_engines  # this client's open requests on each engine
        self._others = [0] * num_engines  # the other clients' ones, as last reported
        self._kv = [0.0] * num_engines
        self._tried = [0.0] * num_engines

    def __len__(self) -> int:
        return len(self.clients)

    def set_client(self, index: int, client: EngineClient | None) -> None:
        with self._lock:
            self.clients[index] = client
            self._mine[index] = self._others[index] = 0

    def live(self, index: int) -> EngineClient | None:
        """Engine `index`'s connection, (re)connecting when there is none (at most every RECONNECT_INTERVAL_S)."""
        client = self.clients[index]
        if client is not None and not client.closed:
            return client
        if self._connect is None or time.monotonic() - self._tried[index] < self.RECONNECT_INTERVAL_S:
            return None
        self._tried[index] = time.monotonic()
        try:
            client = self._connect(index)
        except EngineProcessError:
            return None
        self.set_client(index, client)
        return client

    def pick(self) -> tuple[int, EngineClient]:
        """The least loaded live engine, counted as taking one more request."""
        live = [(i, c) for i in range(len(self.clients)) if (c := self.live(i)) is not None]
        if not live:
            what = (
                "the engine process is" if len(self.clients) == 1 else f"all {len(self.clients)} engine processes are"
            )
            raise EngineProcessError(f"{what} gone (exited and restarting); see the server log")
        with self._lock:
            i, client = min(live, key=lambda ic: (self._mine[ic[0]] + self._others[ic[0]], self._kv[ic[0]], ic[0]))
            if self._mine[i] + self._others[i] >= client.info.capacity:
                # NOTE: a stalled engine reports nothing, so this client's own count is what refuses here; the
                # engine process refuses too (it counts every client's requests: EngineServer._add).
                raise ServerBusy(
                    f"server busy: every engine holds its max_num_seqs={client.info.max_num_seqs} "
                    f"running and max_waiting_requests={client.info.max_waiting_requests} waiting "
                    f"requests; retry later"
                )
            self._mine[i] += 1
        return i, client

    def release(self, index: int, n: int = 1) -> None:
        """`n` of this client's requests on engine `index` ended."""
        with self._lock:
            self._mine[index] = max(0, self._mine[index] - n)

    def report(self, index: int, load: Load) -> None:
        """Engine `index` said how busy it is (every client's requests, this one's included)."""
        with self._lock:
            self._others[index] = max(0, load.requests - self._mine[index])
            self._kv[index] = load.kv_usage

    def load(self, index: int) -> int:
        with self._lock:
            return self._mine[index] + self._others[index]

    def close(self) -> None:
        for client in self.clients:
            if client is not None:
                client.close()
