"""A tritonserver process serving the Ouro model repository (`TritonServer`), and where its binary comes from.

Which server: `$TRITONSERVER` or `tritonserver` on PATH (the NGC container), else the Triton 2.51 server
inside the `nvidia-pytriton` wheel, prepared to run outside a container (`find_tritonserver`). The server
gets the checkpoint in $OURO_MODEL_PATH, the engine options in $OURO_ENGINE_ARGS and the devices in
$OURO_ENGINE_DEVICES; with an admin key, Triton's shared-memory, repository, logging and trace APIs need
the header `ouro-admin-key`. It runs in a process group of its own with umask 077, and its shared-memory
regions are kept private (private_shm). Keeping it serving: supervisor.Supervisor.

Its ports: start() refuses a port that another process listens on (a second server on the same ports),
naming the port and, where /proc tells, the process; and readiness counts only when the answer comes from
this server's own tritonserver (alive, holding the HTTP port), never from another server on its port. Where
util-linux's `setpriv` is found, tritonserver gets SIGTERM (Triton's graceful shutdown, which removes the
engine sockets, keys and manifest) when the process that started it dies, even by SIGKILL.
"""

from __future__ import annotations

import errno
import functools
import glob
import json
import os
import re
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

from ..serving.options import DEVICES_ENV
from .private_shm import PRIVATE_SHM_MODES, SHM_DIR, ShmGuard, private_shm_wrapper
from .procfs import (
    addresses_overlap,
    child_stubs,
    describe_process,
    group_members,
    socket_inodes,
    socket_owner,
    tcp_listeners,
)

ROOT = Path(__file__).resolve().parents[2]  # the source checkout (or site-packages) holding ouro_backend/
REPOSITORY_ENV = "OURO_MODEL_REPOSITORY"
ADMIN_HEADER = "ouro-admin-key"  # HTTP; gRPC clients send it as metadata with tritonserver's prefix:
GRPC_ADMIN_HEADER = "triton-grpc-protocol-" + ADMIN_HEADER
# Everything but inference, health, metadata, statistics and model config (tritonserver's API names; the
# same for --http-restricted-api and --grpc-restricted-protocol). shared-memory is system and CUDA.
RESTRICTED_APIS = "shared-memory,model-repository,logging,trace"


class ServerError(RuntimeError):
    """tritonserver cannot be found, started or made ready, or an option for it is wrong."""


def default_repository() -> Path:
    """$OURO_MODEL_REPOSITORY, else the source checkout's model_repository/, else ./model_repository."""
    if os.environ.get(REPOSITORY_ENV):
        return Path(os.environ[REPOSITORY_ENV]).expanduser()
    for candidate in (ROOT / "model_repository", Path.cwd() / "model_repository"):
        if candidate.is_dir():
            return candidate
    return ROOT / "model_repository"


def cache_dir() -> Path:
    root = os.environ.get("OURO_CACHE_DIR") or os.path.join("~", ".cache", "ouro-triton")
    return Path(root).expanduser()


def _pytriton_dirs() -> tuple[Path, Path] | None:
    """(pytriton/tritonserver, nvidia_pytriton.libs) of the installed nvidia-pytriton wheel, if any."""
    try:
        import importlib.util

        spec = importlib.util.find_spec("pytriton")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return None
    pkg = Path(list(spec.submodule_search_locations)[0])
    server_dir = pkg / "tritonserver"
    libs = pkg.parent / "nvidia_pytriton.libs"
    if not (server_dir / "bin" / "tritonserver").is_file():
        return None
    return server_dir, libs


def find_tritonserver() -> tuple[str, str | None, dict[str, str]]:
    """(tritonserver binary, --backend-directory or None, extra environment)."""
    explicit = os.environ.get("TRITONSERVER")
    if explicit:
        backend_dir = os.environ.get("TRITON_BACKEND_DIR")
        return explicit, backend_dir, {}
    on_path = shutil.which("tritonserver")
    if on_path:
        return on_path, None, {}
    dirs = _pytriton_dirs()
    if dirs is None:
        raise ServerError(
            "no tritonserver found: set $TRITONSERVER, put tritonserver on PATH (the "
            "nvcr.io/nvidia/tritonserver:24.10-py3 container) or `pip install nvidia-pytriton==0.7.0`"
        )
    server_dir, libs = dirs
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = server_dir / "python_backend_stubs" / py / "triton_python_backend_stub"
    if not stub.is_file():
        raise ServerError(f"nvidia-pytriton has no Python backend stub for Python {py} ({stub})")
    src = server_dir / "backends" / "python"
    backends = cache_dir() / "tritonserver-backends" / f"py{py}"
    dst = backends / "python"
    dst.mkdir(parents=True, exist_ok=True)
    for f in [stub, src / "libtriton_python.so", src / "triton_python_backend_utils.py"]:
        target = dst / ("triton_python_backend_stub" if f == stub else f.name)
        if (
            not target.exists()
            or target.stat().st_size != f.stat().st_size
            or target.stat().st_mtime < f.stat().st_mtime
        ):
            tmp = target.with_suffix(f".tmp{os.getpid()}")
            shutil.copy2(f, tmp)
            os.replace(tmp, target)
    env = {"LD_LIBRARY_PATH": os.pathsep.join(p for p in [str(libs), os.environ.get("LD_LIBRARY_PATH", "")] if p)}
    return str(server_dir / "bin" / "tritonserver"), str(backends), env


_ports_handed_out: set[int] = set()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now and not returned before by this process: the kernel may hand the
    port it just released to the next bind, so three calls in a row (http, grpc, metrics) could collide."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _ports_handed_out:
            _ports_handed_out.add(port)
            return port


def bind_error(host: str, port: int) -> OSError | None:
    """What binding a listening socket to `host`:`port` fails with (SO_REUSEADDR set, as tritonserver's
    endpoints bind theirs: a port that only has connections in TIME_WAIT is free), or None if it is free."""
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError):
        return None  # tritonserver says what is wrong with the address
    family, kind, proto, _, address = info
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as e:
            return e
    return None


def numeric_address(host: str) -> str:
    """`host` as the address a socket bound to it reports (localhost -> 127.0.0.1); itself if it does not
    resolve."""
    try:
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][4][0]
    except (socket.gaierror, UnicodeError):
        return host


@functools.cache
def parent_death_wrapper() -> tuple[str, ...]:
    """argv prefix that gives the command SIGTERM when the thread that started it dies, even by SIGKILL
    (util-linux setpriv --pdeathsig; it survives the execs of the private-shm wrapper); () without setpriv."""
    setpriv = shutil.which("setpriv")
    if not setpriv:
        return ()
    try:
        probe = subprocess.run([setpriv, "--pdeathsig", "TERM", "--", "true"], capture_output=True, timeout=10)
        ok = probe.returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return (setpriv, "--pdeathsig", "TERM", "--") if ok else ()


def check_admin_key(key: str) -> str:
    """The key goes into tritonserver's `<apis>:<header>=<key>` option: letters, digits and `._~+/-` only."""
    if not re.fullmatch(r"[A-Za-z0-9._~+/-]+", key or ""):
        raise ServerError("the admin key may hold only letters, digits and . _ ~ + / -")
    return key


def _env_tmpdir(env: Mapping[str, str]) -> str:
    """tempfile.gettempdir() as a process with environment `env` finds it (its TMPDIR, TEMP, TMP)."""
    for var in ("TMPDIR", "TEMP", "TMP"):
        if env.get(var) and os.path.isdir(env[var]):
            return os.path.abspath(env[var])
    return tempfile.gettempdir()


def remove_own(path: str) -> bool:
    """Unlink `path` if it is a file or socket of this user (never follows a link)."""
    try:
        st = os.lstat(path)
        if st.st_uid != os.getuid() or not (stat.S_ISREG(st.st_mode) or stat.S_ISSOCK(st.st_mode)):
            return False
        os.unlink(path)
        return True
    except OSError:
        return False


class TritonServer:
    """A tritonserver process serving the Ouro repository. Use as a context manager or start()/stop().

    Each start() gets a fresh shared-memory region prefix (`shm_prefix`); `pid` stays the last server's pid
    after it is gone, so that cleanup() can remove what it left. stop() and kill() end the whole process
    group (the stubs and engine processes too) and clean up. `admin_key`: keep Triton's shared-memory,
    repository, logging and trace APIs behind the header `ouro-admin-key` (None: open, tritonserver's
    default). `private_shm`: auto, on or off (entrypoints/private_shm.py); `shm_private` says what the last start got
    ("namespace" or "chmod") and `shm_why` why not the namespace. `gpu_metrics`: Triton's nv_gpu_* metrics
    (utilization, memory, power; off for a CPU server, which has none).

    start() fails at once (ServerError) on a port that another process listens on; wait_ready() and is_ready()
    count only answers of this server's own tritonserver (see port_conflict). The server gets SIGTERM when the
    thread that called start() dies (parent_death_wrapper): call it from a thread that lives as long as the
    server (ouro-serve: its main thread; a Supervisor: the thread that runs it)."""

    def __init__(
        self,
        model: str | None = None,
        http_port: int = 8000,
        grpc_port: int = 8001,
        metrics_port: int = 8002,
        model_repository: str | None = None,
        engine_args: Mapping[str, str] | None = None,
        log_file: str | None = None,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        log_verbose: int = 0,
        address: str | None = None,
        devices: str | None = None,
        admin_key: str | None = None,
        private_shm: str = "auto",
        gpu_metrics: bool = False,
    ):
        if private_shm not in PRIVATE_SHM_MODES:
            raise ServerError(f"private_shm={private_shm!r}: expected one of {', '.join(PRIVATE_SHM_MODES)}")
        self.model = model
        self.devices = devices  # engine_devices (None: the repository's, by default auto)
        self.address = address  # None: tritonserver's default (every interface)
        self.http_port, self.grpc_port, self.metrics_port = http_port, grpc_port, metrics_port
        self.model_repository = str(model_repository or default_repository())
        self.engine_args = dict(engine_args or {})
        self.log_dir = None
        if log_file is None:
            self.log_dir = tempfile.mkdtemp(prefix="ouro-triton-")
            log_file = os.path.join(self.log_dir, "tritonserver.log")
        self.log_file = log_file
        self.extra_args = list(extra_args)
        self.extra_env = dict(env or {})
        self.log_verbose = log_verbose
        self.admin_key = check_admin_key(admin_key) if admin_key is not None else None
        self.private_shm = private_shm
        self.gpu_metrics = gpu_metrics
        self.shm_private: str | None = None
        self.shm_why = ""
        self.shm_prefix, self._own_shm_prefix = self._new_shm_prefix()
        self.proc: subprocess.Popen | None = None
        self.pid: int | None = None
        self._tmpdir = tempfile.gettempdir()
        self._log_handle = None
        self._guard: ShmGuard | None = None

    @property
    def host(self) -> str:
        """Where this machine reaches the server."""
        return "localhost" if self.address in (None, "0.0.0.0", "::") else self.address

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    def user_arg(self, option: str) -> str | None:
        """The value of tritonserver option `option` among extra_args (the last), or None."""
        found = None
        for arg in self.extra_args:
            if arg == option or arg.startswith(option + "="):
                found = arg.partition("=")[2]
        return found

    def _new_shm_prefix(self) -> tuple[str, bool]:
        """(prefix for this start's regions, whether it is ours). A user's own prefix is used as is and its
        regions are never removed (other servers may share it)."""
        user = [a for a in self.extra_args if a.startswith("--backend-config=python,shm-region-prefix-name=")]
        if user:
            return user[-1].partition("shm-region-prefix-name=")[2], False
        return f"ouro_shm_{os.getpid()}_{secrets.token_hex(6)}_", True

    def command(self) -> tuple[list[str], dict[str, str]]:
        binary, backend_dir, env_extra = find_tritonserver()
        cmd = [
            binary,
            f"--model-repository={self.model_repository}",
            f"--http-port={self.http_port}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-port={self.metrics_port}",
            "--allow-metrics=true",
            f"--allow-gpu-metrics={'true' if self.gpu_metrics else 'false'}",
        ]
        if self.address:
            cmd += [
                f"--http-address={self.address}",
                f"--grpc-address={self.address}",
                f"--metrics-address={self.address}",
            ]
        if backend_dir:
            cmd.append(f"--backend-directory={backend_dir}")
        if self.log_verbose:
            cmd.append(f"--log-verbose={self.log_verbose}")
        if self._own_shm_prefix:
            cmd.append(f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}")
        if self.admin_key:
            # tritonserver refuses an API named in two groups: a user's own option replaces ours.
            for option in ("--http-restricted-api", "--grpc-restricted-protocol"):
                if self.user_arg(option) is None:
                    cmd.append(f"{option}={RESTRICTED_APIS}:{ADMIN_HEADER}={self.admin_key}")
        cmd += self.extra_args
        env = dict(os.environ)
        env.update(env_extra)
        # The Python backend stub imports packages through the `python3` on PATH: this interpreter's.
        bin_dir = os.path.dirname(sys.executable)
        env["PATH"] = os.pathsep.join([bin_dir, env.get("PATH", "")])
        root = str(ROOT)
        env["PYTHONPATH"] = os.pathsep.join(p for p in [root, env.get("PYTHONPATH", "")] if p)
        if self.model:
            env["OURO_MODEL_PATH"] = str(Path(self.model).expanduser().resolve())
        if self.engine_args:
            env["OURO_ENGINE_ARGS"] = json.dumps(self.engine_args)
        if self.devices:
            env[DEVICES_ENV] = self.devices
        env.update(self.extra_env)
        return cmd, env

    # ------------------------------------------------------------------------------------------ ports
    def endpoints(self) -> list[tuple[str, str, int]]:
        """(name, option, port) of each endpoint tritonserver will listen on and alone (not turned off by an
        extra --allow-http/grpc/metrics=false, nor shared on purpose through --reuse-http/grpc-port)."""
        out = []
        for name, key, port in [
            ("HTTP", "http", self.http_port),
            ("gRPC", "grpc", self.grpc_port),
            ("metrics", "metrics", self.metrics_port),
        ]:
            if (self.user_arg(f"--allow-{key}") or "true").lower() in ("false", "0", "off", "no"):
                continue
            if (self.user_arg(f"--reuse-{key}-port") or "false").lower() in ("true", "1", "on", "yes"):
                continue
            out.append((name, f"--{key}-port", port))
        return out

    @property
    def bind_address(self) -> str:
        return self.address or "0.0.0.0"  # tritonserver's default for all three

    def check_ports(self) -> None:
        """ServerError, naming the port and (where /proc tells) the process, if tritonserver could not listen
        on one of its ports: another process listens there (a second server started on ports in use would
        otherwise load its models and die once it opens its endpoints), or two endpoints share one port."""
        seen: dict[int, str] = {}
        for _, option, port in self.endpoints():
            if port in seen:
                raise ServerError(f"{option} {port}: the same port as {seen[port]}; give each endpoint its own port")
            seen[port] = option
        for name, option, port in self.endpoints():
            if port == 0:
                continue
            error = bind_error(self.bind_address, port)
            if error is None:
                continue
            if error.errno == errno.EADDRINUSE:
                raise ServerError(self._port_in_use(name, option, port))
            raise ServerError(f"cannot listen on {name} port {port} ({option}) on {self.bind_address}: {error}")

    def _port_in_use(self, name: str, option: str, port: int, inode: int | None = None) -> str:
        if inode is None:
            listeners = (tcp_listeners([port]) or {}).get(port, [])
            mine = numeric_address(self.bind_address)
            inode = next((i for addr, i in listeners if addresses_overlap(addr, mine)), None)
        holder = socket_owner(inode) if inode is not None else None
        by = f" by {describe_process(holder)}" if holder is not None else " by another process"
        return (
            f"{name} port {port} ({option}) on {self.bind_address} is already in use{by}: is another server "
            f"(a second ouro-serve?) running on these ports? Stop it, or choose free ports"
        )

    def port_conflict(self) -> str | None:
        """Why the started server cannot be the one answering on its ports: a process other than its
        tritonserver listens on one of them (bound there after check_ports, or on the HTTP port a server that
        is still loading has not opened yet). None when no other one does, or /proc cannot tell."""
        proc = self.proc
        if proc is None:
            return None
        ports = self.endpoints()
        listeners = tcp_listeners([port for _, _, port in ports])
        if not listeners:
            return None
        mine = numeric_address(self.bind_address)
        own: set[int] | None = None
        for name, option, port in ports:
            for addr, inode in listeners[port]:
                if not addresses_overlap(addr, mine):
                    continue
                if own is None:
                    own = socket_inodes(proc.pid)
                    if own is None:  # gone, or not readable: cannot tell
                        return None
                if inode not in own:
                    return self._port_in_use(name, option, port, inode)
        return None

    def _holds_http_port(self) -> bool:
        """Whether this server's tritonserver holds the listening socket of its HTTP port (True where /proc
        cannot tell)."""
        proc = self.proc
        if proc is None:
            return False
        listeners = tcp_listeners([self.http_port])
        if listeners is None:
            return True
        own = socket_inodes(proc.pid)
        return own is None or any(inode in own for _, inode in listeners[self.http_port])

    def start(self, wait: bool = True, timeout: float = 300.0) -> TritonServer:
        self.check_ports()
        self.shm_prefix, self._own_shm_prefix = self._new_shm_prefix()
        cmd, env = self.command()
        wrapper, self.shm_why = (None, "--private-shm off") if self.private_shm == "off" else private_shm_wrapper()
        if wrapper is None and self.private_shm == "on":
            raise ServerError(f"--private-shm on: cannot give tritonserver a private /dev/shm: {self.shm_why}")
        self.shm_private = "namespace" if wrapper else "chmod"
        self._tmpdir = _env_tmpdir(env)
        self._log_handle = open(self.log_file, "ab")
        self.proc = subprocess.Popen(
            list(parent_death_wrapper()) + list(wrapper or ()) + cmd,
            stdout=self._log_handle,
            stderr=subprocess.STDOUT,
            env=env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            umask=0o077,
        )
        self.pid = self.proc.pid  # tritonserver's own: the wrappers exec it
        if wrapper is None:
            self._guard = ShmGuard(self.shm_prefix)
            self._guard.start()
        if wait:
            self.wait_ready(timeout)
        return self

    def mark_ready(self) -> None:
        """Readiness seen: the shm guard may poll slowly from now on."""
        if self._guard is not None:
            self._guard.relax()

    def is_ready(self) -> bool:
        """/v2/health/ready answers 200, and the answer is this server's: its tritonserver is alive and holds
        the HTTP port (another server on that port, say the first of two started on the same ports, would
        answer for it otherwise)."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as r:
                if r.status != 200:
                    return False
        except (urllib.error.URLError, OSError, ValueError):
            return False
        return self._holds_http_port() and proc.poll() is None

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise ServerError(
                    f"tritonserver exited with code {self.proc.returncode} before it was ready; "
                    f"log {self.log_file}:\n{self.log_tail()}"
                )
            conflict = self.port_conflict()
            if conflict is not None:
                raise ServerError(conflict)
            if self.is_ready():
                self.mark_ready()
                return
            time.sleep(0.5)
        raise ServerError(
            f"tritonserver not ready after {timeout:.0f}s ({self.model_states_text()}); "
            f"log {self.log_file}:\n{self.log_tail()}"
        )

    def model_states(self) -> dict[str, str] | None:
        """Each model's state from the repository index (``READY``, ``LOADING``, ``UNAVAILABLE: reason``...),
        or None when the HTTP endpoint does not answer it (not up yet, or the index is restricted and this
        server's admin key unknown)."""
        headers = {ADMIN_HEADER: self.admin_key} if self.admin_key else {}
        req = urllib.request.Request(f"http://{self.http_url}/v2/repository/index", data=b"{}", headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=2) as r:
                index = json.loads(r.read())
        except (urllib.error.URLError, OSError, ValueError):
            return None
        return {
            m.get("name", "?"): m.get("state", "?") + (f": {m['reason']}" if m.get("reason") else "")
            for m in index
            if isinstance(m, dict)
        }

    def model_states_text(self) -> str:
        """`model_states` in one phrase, for errors."""
        states = self.model_states()
        if states is None:
            return "its HTTP endpoint does not answer the repository index"
        return "models: " + ", ".join(f"{name} {state}" for name, state in sorted(states.items()))

    def log_text(self) -> str:
        try:
            return Path(self.log_file).read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 60) -> str:
        try:
            with open(self.log_file, "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - 256 * 1024))
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def note(self, text: str) -> None:
        """Append a line of ouro-serve's own to the server log."""
        with open(self.log_file, "ab") as f:
            f.write(f"--- ouro-serve {time.strftime('%Y-%m-%d %H:%M:%S')}: {text}\n".encode())

    def stubs(self) -> dict[int, tuple[int, str]]:
        """The running server's live Python backend stubs (child_stubs); {} when none runs."""
        if self.proc is None or self.proc.poll() is not None:
            return {}
        return child_stubs(self.proc.pid)

    def stale_files(self) -> list[str]:
        """What the last server (`pid`) leaves if it dies: its engine sockets, keys and manifests
        (engine_auth.engine_address / key_path, engine_pool.manifest_path: `engine-<pid>-*` in
        `<tmp>/ouro-triton-<uid>`) and, with our own prefix, its shared-memory regions in /dev/shm."""
        if self.pid is None:
            return []
        directory = os.path.join(self._tmpdir, f"ouro-triton-{os.getuid()}")
        found = glob.glob(os.path.join(glob.escape(directory), f"engine-{self.pid}-*"))
        if self._own_shm_prefix:
            found += glob.glob(os.path.join(SHM_DIR, glob.escape(self.shm_prefix) + "*"))
        return found

    def cleanup(self) -> list[str]:
        """Remove stale_files() (only this user's files and sockets); returns what was removed. Only for a
        server that is gone."""
        return [path for path in self.stale_files() if remove_own(path)]

    def kill(self) -> int | None:
        """SIGKILL the whole process group now (tritonserver, stubs, engine processes: its clients see their
        connections drop), reap tritonserver and clean up. Returns its exit code."""
        proc, self.proc = self.proc, None
        code = None
        if proc is not None:
            # The stubs and engine processes live in the server's process group (start_new_session): a
            # crashed server leaves them running otherwise.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
            # Until they are gone: a dying engine process may still hold the GPU memory the next needs.
            deadline = time.monotonic() + 10
            while group_members(proc.pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            code = proc.returncode
        if self._guard is not None:
            self._guard.stop()
            self._guard = None
        self.cleanup()
        if self._log_handle is not None:
            self._log_handle.close()
            self._log_handle = None
        return code

    def stop(self, timeout: float = 60.0, hurry: threading.Event | None = None) -> int | None:
        """Triton's graceful shutdown (SIGINT: models unloaded, finalize()), then kill() what is left after
        `timeout` seconds (or once `hurry` is set). Returns tritonserver's exit code (-9 if it was killed)."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            deadline = time.monotonic() + timeout
            while proc.poll() is None and time.monotonic() < deadline and not (hurry and hurry.is_set()):
                try:
                    proc.wait(min(0.2, max(0.0, deadline - time.monotonic())))
                except subprocess.TimeoutExpired:
                    pass
        return self.kill()

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
