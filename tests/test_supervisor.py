"""`ouro-serve`'s supervision and local privacy against a REAL tritonserver (Triton 2.51) on the toy checkpoint.

One supervised server for the first three tests (entrypoints/supervisor.py, in a thread, with an admin
key and `private_shm="off"`: its shared-memory regions are in this host's /dev/shm, chmod 0600 by the
launcher), in order: a 4.5 MB form POST crashes tritonserver (Triton 2.51's SIGSEGV) and the supervisor
serves again; a killed `ouro` stub drops its clients and the server is restarted; a second local user can
neither read the regions nor use the shared-memory API without the key; a second `ouro-serve` on the same
ports fails at once with a message naming the port and leaves nothing behind, and a server that loses the
race for a port (the check skipped) is never taken for ready. Then `ouro-serve` itself (a private /dev/shm
in a mount namespace where it can make one), stopped with SIGTERM, and killed with SIGKILL (its tritonserver
goes too, and removes the engine's files).

The 60 s / 10 s / 15 s bounds are the requirements under test, not measurements of speed.
"""

from __future__ import annotations

import glob
import json
import os
import queue
import re
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
from helpers import ouro_serve_cmd, wait_for

from client.ouro_client import generate, request_options
from ouro_backend.entrypoints.procfs import (
    child_stubs,
    cpu_seconds,
    descendants,
    group_members,
    process_argv,
    stub_model,
)
from ouro_backend.entrypoints.supervisor import Supervisor
from ouro_backend.entrypoints.tritonserver import (
    ADMIN_HEADER,
    GRPC_ADMIN_HEADER,
    ServerError,
    TritonServer,
    find_tritonserver,
    free_port,
    parent_death_wrapper,
)
from ouro_backend.serving.engine_auth import private_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.timeout(300)

ENGINE_ARGS = {"device": "cpu", "dtype": "float32"}
PROMPT = "Once upon a time there was a little robot who"
KEY = "test-admin-key-0123456789"
OTHER_USER = "ouro-test-other"
SHORT = request_options(max_tokens=8, temperature=0.0, stream=True)


def _tritonserver_or_skip() -> None:
    try:
        find_tritonserver()
    except ServerError as e:
        pytest.skip(f"no tritonserver available: {e}")


def restarts_metric(server: TritonServer) -> float:
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    found = re.findall(r'^ouro_server_restarts_total\{[^}]*model="ouro_engine"[^}]*\} (\S+)$', text, re.M)
    assert found, "no ouro_server_restarts_total on the metrics port"
    return float(found[0])


def shm_regions(server_pid: int) -> dict[int, str]:
    """{stub pid: its shared-memory region's name} (the stub's argv[2], what `ps` shows anyone)."""
    out = {}
    for pid in child_stubs(server_pid):
        argv = process_argv(pid)
        if argv is not None:
            out[pid] = argv[2].decode().lstrip("/")
    return out


def group_alive(pgid: int) -> bool:
    return bool(group_members(pgid))


def served(url: str) -> bool:
    r = generate(url, "ouro", PROMPT, SHORT, timeout=60)
    return r.error is None and r.num_tokens == 8


def other_user() -> str:
    """A second local user (created when missing); skips unless this runs as root."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to run commands as a second local user")
    if not shutil.which("runuser"):
        pytest.skip("no runuser")
    if subprocess.run(["id", "-u", OTHER_USER], capture_output=True).returncode != 0:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", OTHER_USER],
            check=True,
            capture_output=True,
        )
    return OTHER_USER


def as_other(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["runuser", "-u", other_user(), "--", *cmd], capture_output=True, text=True, timeout=60, cwd="/"
    )


@pytest.fixture(scope="module")
def supervised(toy_path, request):
    _tritonserver_or_skip()
    server = TritonServer(
        model=toy_path,
        engine_args=ENGINE_ARGS,
        address="127.0.0.1",
        http_port=free_port(),
        grpc_port=free_port(),
        metrics_port=free_port(),
        admin_key=KEY,
        private_shm="off",
    )
    print(f"\ntritonserver log: {server.log_file}", flush=True)
    sup = Supervisor(server, ready_timeout=240)
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("code", sup.run()), name="supervisor", daemon=True)
    thread.start()
    failed_before = request.session.testsfailed
    try:
        assert sup.ready.wait(240), f"not ready; log {server.log_file}:\n{server.log_tail()}"
        yield sup
    finally:
        last_pid = server.pid
        sup.request_stop()
        thread.join(60)
        if request.session.testsfailed > failed_before:
            print(f"\n--- tritonserver log tail ({server.log_file}) ---\n{server.log_tail(100)}")
        assert not thread.is_alive(), "the supervisor did not stop"
        assert result.get("code") == 0
        assert server.stale_files() == [], "stop() left files behind"
        assert not group_alive(last_pid)


def test_large_form_post_crash_is_restarted_and_cleaned(supervised):
    """Triton 2.51 dies with SIGSEGV on a form-encoded POST body of ~4 MB or more; the supervisor removes
    what the dead server left (engine socket, key, manifest; shared-memory regions), restarts it, and it
    serves again within 60 s, with the restart counted in ouro_server_restarts_total."""
    server = supervised.server
    pid, before = server.pid, supervised.restarts
    regions = shm_regions(pid)
    assert regions and all(name.startswith(server.shm_prefix) for name in regions.values())
    for name in regions.values():  # made 0600 by the launcher's guard (Triton makes them 0644)
        assert stat.S_IMODE(os.stat(f"/dev/shm/{name}").st_mode) == 0o600, name
    stale = server.stale_files()
    assert {re.sub(r".*engine-\d+-ouro_engine", "", p) for p in stale} >= {"-0.sock", "-0.sock.key", ".json"}, stale
    assert served(server.grpc_url)

    crashed = time.monotonic()
    body = b"a" * 4_500_000
    req = urllib.request.Request(
        f"http://{server.http_url}/v2/health/ready",
        data=body,
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    )
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
        urllib.request.urlopen(req, timeout=30)
    assert wait_for(lambda: server.pid != pid, timeout=30), "tritonserver did not die (or was not restarted)"
    # Removed before the new server starts, and nothing of the old process group is left.
    assert [p for p in stale if os.path.exists(p)] == []
    assert [n for n in regions.values() if os.path.exists(f"/dev/shm/{n}")] == []
    assert not group_alive(pid)

    assert wait_for(
        lambda: supervised.ready.is_set() and served(server.grpc_url),
        timeout=60 - (time.monotonic() - crashed),
        interval=0.5,
    ), f"not serving 60 s after the crash; log {server.log_file}:\n{server.log_tail()}"
    print(f"\ncrash -> ready: {supervised.recoveries[-1]:.1f} s; crash -> served: {time.monotonic() - crashed:.1f} s")
    assert supervised.restarts == before + 1
    assert restarts_metric(server) == supervised.restarts
    assert "exited with code -11 (SIGSEGV)" in server.log_text() or "Signal (11)" in server.log_text()


def test_killed_stub_drops_its_streams_and_the_server_is_restarted(supervised):
    """A dead `ouro` stub leaves Triton 2.51 unable to serve while it says ready: the supervisor kills the
    server's process group, so every open stream ends with an error within 10 s, and serves again."""
    server = supervised.server
    pid, before = server.pid, supervised.restarts
    ouro_stubs = [p for p, (_, model) in child_stubs(pid).items() if model == "ouro"]
    assert len(ouro_stubs) == 2, child_stubs(pid)
    opts = request_options(max_tokens=1900, ignore_eos=True, temperature=0.0, stream=True)
    n = 3
    started = [threading.Event() for _ in range(n)]
    results: dict = {}

    def run(i):
        results[i] = generate(server.grpc_url, "ouro", PROMPT, opts, timeout=60, on_chunk=lambda c: started[i].set())

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    assert all(e.wait(60) for e in started), "the streams did not start"
    killed = time.monotonic()
    os.kill(ouro_stubs[0], signal.SIGKILL)
    for t in threads:
        t.join(timeout=30)
    for i in range(n):
        r = results[i]
        assert r.error is not None, f"stream {i} ended without an error ({r.num_tokens} tokens)"
        assert r.end - killed < 10, f"stream {i} failed only {r.end - killed:.1f} s after the kill: {r.error}"
    print(
        f"\nstub killed -> every stream failed: {max(r.end for r in results.values()) - killed:.1f} s "
        f"({results[0].error[:80]!r})"
    )
    assert wait_for(
        lambda: supervised.ready.is_set() and server.pid != pid and served(server.grpc_url), timeout=120, interval=0.5
    ), server.log_tail()
    assert supervised.restarts == before + 1
    assert "Python backend stub of model 'ouro'" in server.log_text()
    assert not group_alive(pid)


def test_second_local_user_cannot_read_shm_or_use_admin_apis(supervised):
    """Another local user sees the shared-memory regions' names (`ps`) but cannot read them, and the
    shared-memory API refuses anyone without the admin key (HTTP and gRPC); with the key it works."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    import tritonclient.utils.shared_memory as shm
    from tritonclient.utils import InferenceServerException

    server = supervised.server
    regions = shm_regions(server.pid)
    assert regions
    for name in regions.values():
        r = as_other("cat", f"/dev/shm/{name}")
        assert r.returncode != 0 and "Permission denied" in r.stderr, (name, r.returncode, r.stderr)

    def post(path: str, *headers: str) -> str:
        r = as_other(
            "curl",
            "-s",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "-X",
            "POST",
            "-H",
            "Content-Type: application/json",
            *[a for h in headers for a in ("-H", h)],
            "-d",
            json.dumps({"key": "/ouro_test_region", "offset": 0, "byte_size": 64}),
            f"http://{server.http_url}{path}",
        )
        return r.stdout

    assert post("/v2/systemsharedmemory/region/x/register") == "403"
    assert post("/v2/cudasharedmemory/region/x/register") == "403"
    assert post("/v2/repository/index") == "403"
    assert post("/v2/systemsharedmemory/region/x/register", f"{ADMIN_HEADER}: wrong") == "403"
    assert post("/v2/systemsharedmemory/region/x/register", f"{ADMIN_HEADER}: {KEY}") != "403"

    region = shm.create_shared_memory_region("ouro_test_region", "/ouro_test_region", 64)
    try:
        http = httpclient.InferenceServerClient(server.http_url)
        grpc = grpcclient.InferenceServerClient(server.grpc_url)
        for client in (http, grpc):
            with pytest.raises(InferenceServerException, match="restricted"):
                client.register_system_shared_memory("r", "/ouro_test_region", 64)
        # gRPC: tritonserver expects the header with its prefix triton-grpc-protocol-.
        with pytest.raises(InferenceServerException, match="restricted"):
            grpc.register_system_shared_memory("r", "/ouro_test_region", 64, headers={ADMIN_HEADER: KEY})
        grpc.register_system_shared_memory("r", "/ouro_test_region", 64, headers={GRPC_ADMIN_HEADER: KEY})
        assert "/ouro_test_region" in json.dumps(http.get_system_shared_memory_status(headers={ADMIN_HEADER: KEY}))
        http.unregister_system_shared_memory("r", headers={ADMIN_HEADER: KEY})
        # Inference, health, metadata, statistics and model config stay open.
        assert http.is_server_ready() and http.get_model_metadata("ouro") and http.get_model_config("ouro")
        assert http.get_inference_statistics("ouro")
    finally:
        shm.destroy_shared_memory_region(region)


def socket_dir_files() -> set[str]:
    return set(os.listdir(private_dir()))


@pytest.mark.parametrize("busy", ["http", "grpc"])
def test_second_ouro_serve_on_busy_ports_fails_fast_and_leaves_nothing(supervised, toy_path, tmp_path, busy):
    """`ouro-serve` on a port the supervised server listens on: exit code 1 within seconds, before any
    tritonserver starts, with a message naming the port, its option and the server that holds it; never
    "ready" (the first server's answer is not its own); nothing new in the engine sockets' directory (its
    admin key file removed) and no log written."""
    server = supervised.server
    assert supervised.ready.is_set()
    ports = {"http": free_port(), "grpc": free_port(), "metrics": free_port()}
    ports[busy] = server.http_port if busy == "http" else server.grpc_port
    before = socket_dir_files()
    log = tmp_path / "second.log"
    env = {k: v for k, v in os.environ.items() if k != "OURO_ADMIN_KEY"}  # so it writes an admin key file
    started = time.monotonic()
    r = subprocess.run(
        ouro_serve_cmd(toy_path, str(log), ports["http"], ports["grpc"], ports["metrics"]),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    took = time.monotonic() - started
    out = r.stdout + r.stderr
    name, option = {"http": ("HTTP", "--http-port"), "grpc": ("gRPC", "--grpc-port")}[busy]
    assert r.returncode == 1, out
    assert (
        f"ouro-serve: {name} port {ports[busy]} ({option}) on 127.0.0.1 is already in use by pid {server.pid} "
        f"(tritonserver)" in r.stderr
    ), out
    assert "ouro-serve: ready" not in out and "exited with" not in out, out
    assert took < 30, f"{took:.1f} s to refuse a busy port"
    assert socket_dir_files() <= before, socket_dir_files() - before
    assert not log.exists(), "a tritonserver was started"
    assert served(server.grpc_url)  # the first server is untouched


def test_a_server_that_loses_a_port_is_never_taken_for_ready(supervised, toy_path, monkeypatch):
    """The port check skipped, as when another process takes the port between the check and tritonserver's
    bind: the new server's readiness never counts the running server's answers on that port (is_ready is
    False even while that one says 200), the Supervisor ends the start at once, naming the port and its
    holder, and the loser's process group and files are gone."""
    first = supervised.server
    second = TritonServer(
        model=toy_path,
        engine_args=ENGINE_ARGS,
        address="127.0.0.1",
        http_port=first.http_port,  # first's HTTP port answers 200 for /v2/health/ready
        grpc_port=free_port(),
        metrics_port=free_port(),
        private_shm="off",
    )
    assert first.is_ready() and not second.is_ready(), "another server's answer is not this one's readiness"
    with pytest.raises(ServerError, match=f"HTTP port {first.http_port} .* already in use by pid {first.pid}"):
        second.check_ports()
    monkeypatch.setattr(second, "check_ports", lambda: None)  # lose the race: start anyway
    said: list[str] = []
    ready: list = []
    sup = Supervisor(second, ready_timeout=240, on_ready=ready.append, log=said.append)
    started = time.monotonic()
    code = sup.run()
    took = time.monotonic() - started
    assert code == 1 and not ready, said
    assert f"HTTP port {first.http_port} (--http-port) on 127.0.0.1 is already in use by pid {first.pid}" in said[0]
    assert took < 15, f"{took:.1f} s: the conflict should end the start long before the models are loaded"
    assert second.proc is None and second.stale_files() == [] and not group_alive(second.pid)
    assert served(first.grpc_url)


def start_ouro_serve(toy_path, tmp_path) -> tuple[subprocess.Popen, list[str], int]:
    """`ouro-serve` with defaults (a random admin key in a private file) on free ports, once ready: (its
    process, its output so far, which grows, tritonserver's pid)."""
    env = {k: v for k, v in os.environ.items() if k != "OURO_ADMIN_KEY"}
    cmd = ouro_serve_cmd(toy_path, str(tmp_path / "log"), free_port(), free_port(), free_port())
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue[str] = queue.Queue()
    output: list[str] = []

    def read():
        for line in proc.stdout:
            output.append(line)
            lines.put(line)

    threading.Thread(target=read, daemon=True).start()
    try:
        deadline = time.monotonic() + 240
        ready = None
        while ready is None and time.monotonic() < deadline and proc.poll() is None:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                continue
            ready = re.search(r"ouro-serve: ready \(tritonserver pid (\d+)", line)
        assert ready, "".join(output) + (tmp_path / "log").read_text(errors="replace")[-4000:]
        time.sleep(0.5)  # the banner's remaining lines
    except BaseException:
        stop_ouro_serve(proc)
        raise
    return proc, output, int(ready.group(1))


def stop_ouro_serve(proc: subprocess.Popen) -> None:
    """What a test's cleanup does to an ouro-serve still running: SIGTERM (it stops its server and removes
    its files), SIGKILL only if that does not end it."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def test_sigterm_stops_ouro_serve_cleanly(toy_path, tmp_path):
    """`ouro-serve` with defaults (a private /dev/shm where possible, a random admin key in a private file):
    both models serve; a SIGTERM stops it within 15 s, exit code 0, with no file or process left."""
    _tritonserver_or_skip()
    proc, output, server_pid = start_ouro_serve(toy_path, tmp_path)
    try:
        text = "".join(output)
        grpc = re.search(r"gRPC +(\S+)", text).group(1)
        key_file = re.search(r"the key in (\S+)", text).group(1)
        assert os.path.dirname(key_file) == private_dir()
        assert stat.S_IMODE(os.stat(key_file).st_mode) == 0o600
        key = open(key_file).read().strip()
        assert len(key) >= 32 and key not in text
        namespace = "private /dev/shm (mount namespace)" in text
        regions = shm_regions(server_pid)
        assert regions
        for stub, name in regions.items():
            if namespace:  # only inside the server's mount namespace
                assert not os.path.exists(f"/dev/shm/{name}")
                assert os.path.exists(f"/proc/{stub}/root/dev/shm/{name}")
                if os.geteuid() == 0:
                    r = as_other("cat", f"/proc/{stub}/root/dev/shm/{name}")
                    assert r.returncode != 0, r
            else:
                assert stat.S_IMODE(os.stat(f"/dev/shm/{name}").st_mode) == 0o600
        for model in ("ouro", "ouro_ensemble"):
            r = generate(grpc, model, PROMPT, SHORT, timeout=60)
            assert r.error is None and r.num_tokens == 8, (model, r.error)
        engine_files = glob.glob(os.path.join(private_dir(), f"engine-{server_pid}-*"))
        assert engine_files

        stopping = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        took = time.monotonic() - stopping
        print(f"\nSIGTERM -> exit: {took:.1f} s (private /dev/shm: {namespace})")
        assert code == 0, "".join(output)
        assert took < 15, f"ouro-serve took {took:.1f} s to stop"
        assert [p for p in engine_files if os.path.exists(p)] == []
        assert glob.glob(os.path.join(private_dir(), f"engine-{server_pid}-*")) == []
        assert [n for n in regions.values() if os.path.exists(f"/dev/shm/{n}")] == []
        assert not os.path.exists(key_file)
        assert not group_alive(server_pid)
    finally:
        stop_ouro_serve(proc)


def test_sigkill_of_ouro_serve_takes_its_server_and_the_engine_files_with_it(toy_path, tmp_path):
    """`ouro-serve` killed with SIGKILL cannot clean up: its tritonserver (parent-death signal SIGTERM) shuts
    down gracefully by itself, its engine sockets, keys and manifest are removed, and no process of its
    group is left. Only ouro-serve's own admin key file stays (nothing is left to remove it)."""
    _tritonserver_or_skip()
    if not parent_death_wrapper():
        pytest.skip("no util-linux setpriv with --pdeathsig")
    proc, output, server_pid = start_ouro_serve(toy_path, tmp_path)
    key_file = re.search(r"the key in (\S+)", "".join(output))
    try:
        assert key_file, "".join(output)
        engine_files = glob.glob(os.path.join(private_dir(), f"engine-{server_pid}-*"))
        assert engine_files
        proc.kill()
        proc.wait(10)
        assert wait_for(lambda: not group_alive(server_pid), timeout=60), "tritonserver outlived ouro-serve"
        assert glob.glob(os.path.join(private_dir(), f"engine-{server_pid}-*")) == []
        log = (tmp_path / "log").read_text(errors="replace")
        assert "successfully unloaded 'ouro_engine'" in log, log[-3000:]  # Triton's graceful shutdown
    finally:
        stop_ouro_serve(proc)
        if key_file and os.path.exists(key_file.group(1)):
            os.unlink(key_file.group(1))


def test_restricted_api_options_and_a_users_own(toy_path):
    """With a key, tritonserver gets both restricted-API options; a user's own option for one protocol
    replaces ours there (tritonserver refuses an API named twice), and each start has its own shm prefix."""
    _tritonserver_or_skip()
    ours, _ = TritonServer(model=toy_path, admin_key=KEY).command()
    assert [a for a in ours if "restricted" in a] == [
        f"--http-restricted-api=shared-memory,model-repository,logging,trace:{ADMIN_HEADER}={KEY}",
        f"--grpc-restricted-protocol=shared-memory,model-repository,logging,trace:{ADMIN_HEADER}={KEY}",
    ]
    mine = "--http-restricted-api=shared-memory:my-key=1"
    server = TritonServer(model=toy_path, admin_key=KEY, extra_args=[mine])
    cmd, _ = server.command()
    assert [a for a in cmd if "restricted" in a] == [
        f"--grpc-restricted-protocol=shared-memory,model-repository,logging,trace:{ADMIN_HEADER}={KEY}",
        mine,
    ]
    assert not any("restricted" in a for a in TritonServer(model=toy_path).command()[0])
    with pytest.raises(ServerError, match="admin key"):
        TritonServer(model=toy_path, admin_key="a key with spaces")
    first = server.shm_prefix
    assert f"--backend-config=python,shm-region-prefix-name={first}" in cmd
    assert TritonServer(model=toy_path).shm_prefix != first


def test_gives_up_after_consecutive_failed_restarts(toy_path):
    """A server that dies and then cannot start again (here tritonserver refuses an option) is retried
    `max_failed_starts` times, then run() gives up with exit code 1 and says so."""
    _tritonserver_or_skip()
    server = TritonServer(
        model=toy_path,
        engine_args=ENGINE_ARGS,
        address="127.0.0.1",
        http_port=free_port(),
        grpc_port=free_port(),
        metrics_port=free_port(),
    )
    said: list[str] = []
    sup = Supervisor(server, ready_timeout=240, max_failed_starts=2, backoff_s=0.1, log=said.append)
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("code", sup.run()), daemon=True)
    thread.start()
    try:
        assert sup.ready.wait(240), server.log_tail()
        server.extra_args.append("--no-such-option=1")  # every later start fails at once
        os.kill(server.pid, signal.SIGKILL)
        thread.join(240)
        assert not thread.is_alive()
    finally:
        sup.request_stop()
        thread.join(60)
    assert result["code"] == 1, said
    assert sup.restarts == 2 and "giving up: 2 restart(s) in a row did not reach readiness" in said[-1], said
    assert "exited with code -9 (SIGKILL)" in said[0]
    assert "exited with code 1 before it was ready" in said[1], said
    assert server.proc is None and server.stale_files() == []


def test_procfs_descendants_cpu_seconds_and_stub_model():
    """What served.py's CPU accounting reads: a busy child is below us and has used CPU time; a stub's
    argv names its model, another program's does not."""
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\ntime.sleep(30)",
        ]
    )
    try:
        assert wait_for(lambda: (cpu_seconds(child.pid) or 0) >= 0.25, timeout=30)
        assert child.pid in descendants(os.getpid()) and os.getpid() in descendants(os.getpid())
        assert descendants(child.pid) == {child.pid}
    finally:
        child.kill()
        child.wait()
    assert cpu_seconds(child.pid) is None  # gone (reaped)
    argv = [b"/opt/tritonserver/backends/python/triton_python_backend_stub", b"/repo/ouro/1/model.py", b"shm"]
    assert stub_model(argv) == "ouro" and stub_model([b"/usr/bin/python3", b"-m", b"x"]) is None
