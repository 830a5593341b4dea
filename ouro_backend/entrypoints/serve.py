"""`ouro-serve`: start Triton Inference Server on the Ouro model repository, and keep it serving.

    ouro-serve [--model DIR] [--address 0.0.0.0] [--http-port 8000] [--grpc-port 8001] [--metrics-port 8002]
               [--devices auto|cuda:0,cuda:1|cpu] [--engine-arg key=value ...] [--model-repository DIR]
               [--log-file PATH] [--log-verbose N] [--private-shm auto|on|off] [--admin-key KEY]
               [--no-restrict-apis] [--max-failed-starts N] [--no-restart] [--stop-grace S]

Devices: one engine process per device, each request to the least loaded; by default every GPU that
CUDA_VISIBLE_DEVICES leaves visible (else the CPU). Said at start.

Supervision: if tritonserver dies without being asked to (a signal such as the SIGSEGV that Triton 2.51
takes on a form-encoded POST body of ~4 MB or more, any exit code), or one of its Python backend stubs dies
while it lives on (Triton 2.51 never restarts a stub: its clients would hang and about half of the new
requests fail while /v2/health/ready says 200), ouro-serve kills what is left of its process group, removes
the files it left (engine sockets, keys and manifest named with its pid, its shared-memory regions), logs
the exit code and the log tail, and starts it again: after 1 s, doubling up to 30 s for a server that
crashes again within 60 s of being ready. A start that does not reach readiness counts as failed; after
--max-failed-starts (5) in a row ouro-serve gives up with exit code 1 (the first start is not retried: if
it fails, the configuration is the problem). Each server gets the restart count in $OURO_SERVER_RESTARTS,
published as `ouro_server_restarts_total` on the metrics port. --no-restart: exit when the server dies.

Network exposure: HTTP, gRPC and metrics bind to --address, by default 0.0.0.0 (every interface, as
tritonserver does): anyone who can reach the ports can run inference and read the metrics and statistics.
Use --address 127.0.0.1 to serve this host only (behind a proxy, which should also cap request bodies:
tritonserver 2.51 has no option to). Triton's shared-memory (system and CUDA), model-repository/control,
logging and trace APIs need the header `ouro-admin-key: KEY` (gRPC: metadata
`triton-grpc-protocol-ouro-admin-key`, tritonserver's prefix): KEY from $OURO_ADMIN_KEY
(or --admin-key, which `ps` shows), else a fresh random key per run, in a file only this user can read
(its path is printed, the key is not). The key is on tritonserver's command line, which local users can
read: it guards against the network. A --tritonserver-arg=--http-restricted-api=... (or
--grpc-restricted-protocol) of your own replaces ours for that protocol; --no-restrict-apis turns it off.
The engine process is reached only through a Unix socket in a directory private to this user, with a
per-server key.

Local privacy: tritonserver runs with umask 077. The Python backend's shared-memory regions with each stub
(Triton makes them mode 0644 whatever the umask) get a per-start name prefix; --private-shm on: tritonserver
runs in a mount namespace of its own with a private tmpfs on /dev/shm (root, or unprivileged user
namespaces), so no other user sees the regions; off: the regions are chmod 0600 as soon as they appear
(polled), which a local user can race; auto (default): the namespace when it works, else off's polling.
In the namespace, tritonserver cannot see /dev/shm regions that clients register as system shared memory
(CUDA shared memory works): use --private-shm off for that.

Which server: `$TRITONSERVER` or `tritonserver` on PATH (the NGC container), else the Triton 2.51 server
inside the `nvidia-pytriton` wheel, prepared to run outside a container: the Python
backend (library + the stub built for this Python) is copied into a writable cache dir
($OURO_CACHE_DIR or ~/.cache/ouro-triton/tritonserver-backends), LD_LIBRARY_PATH gets the wheel's
`nvidia_pytriton.libs`, and this interpreter's bin dir goes first on PATH (the stub finds its packages
through the `python3` on PATH; numpy must be < 2 there).

The checkpoint reaches the models through $OURO_MODEL_PATH (`--model`; default: the demo model shipped
with the package) and extra engine options through $OURO_ENGINE_ARGS (`--engine-arg`), which override
the `parameters` of ouro_engine/config.pbtxt. Engine args are validated before the server starts.

The server's output goes to a log file (printed at start; its tail is printed if the server fails; every
restart appends to it). Ctrl-C / SIGTERM stop the server: Triton's graceful shutdown, killed after
--stop-grace seconds (10; a second Ctrl-C kills at once); exit code 0.
"""
from __future__ import annotations

import argparse
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
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

from ..serving.engine_pool import resolve_devices, visible_gpus
from ..serving.engine_process import EngineProcessError, private_dir
from ..serving.metrics import RESTARTS_ENV
from ..serving.options import DEVICES_ENV

ROOT = Path(__file__).resolve().parents[1]
REPOSITORY_ENV = "OURO_MODEL_REPOSITORY"
ADMIN_KEY_ENV = "OURO_ADMIN_KEY"
ADMIN_HEADER = "ouro-admin-key"  # HTTP; gRPC clients send it as metadata with tritonserver's prefix:
GRPC_ADMIN_HEADER = "triton-grpc-protocol-" + ADMIN_HEADER
# Everything but inference, health, metadata, statistics and model config (tritonserver's API names; the
# same for --http-restricted-api and --grpc-restricted-protocol). shared-memory is system and CUDA.
RESTRICTED_APIS = "shared-memory,model-repository,logging,trace"
STUB = "triton_python_backend_stub"
SHM_DIR = "/dev/shm"
PRIVATE_SHM_MODES = ("auto", "on", "off")

def default_repository() -> Path:
    """$OURO_MODEL_REPOSITORY, else the source checkout's model_repository/, else ./model_repository."""
    if os.environ.get(REPOSITORY_ENV):
        return Path(os.environ[REPOSITORY_ENV]).expanduser()
    for candidate in (ROOT / "model_repository", Path.cwd() / "model_repository"):
        if candidate.is_dir():
            return candidate
    return ROOT / "model_repository"


DEFAULT_REPOSITORY = default_repository()
MODELS = ("preprocessing", "postprocessing", "ouro_engine", "ouro", "ouro_ensemble")


class ServerError(RuntimeError):
    pass


def cache_dir() -> Path:
    root = os.environ.get("OURO_CACHE_DIR") or os.path.join("~", ".cache", "ouro-triton")
    return Path(root).expanduser()


def _pytriton_dirs() -> Optional[tuple[Path, Path]]:
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


def find_tritonserver() -> tuple[str, Optional[str], dict[str, str]]:
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
        raise ServerError("no tritonserver found: set $TRITONSERVER, put tritonserver on PATH (the "
                          "nvcr.io/nvidia/tritonserver:24.10-py3 container) or `pip install nvidia-pytriton==0.7.0`")
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
        if not target.exists() or target.stat().st_size != f.stat().st_size or \
                target.stat().st_mtime < f.stat().st_mtime:
            tmp = target.with_suffix(f".tmp{os.getpid()}")
            shutil.copy2(f, tmp)
            os.replace(tmp, target)
    env = {"LD_LIBRARY_PATH": os.pathsep.join(p for p in [str(libs), os.environ.get("LD_LIBRARY_PATH", "")] if p)}
    return str(server_dir / "bin" / "tritonserver"), str(backends), env


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_engine_args(items: Sequence[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ServerError(f"--engine-arg {item!r}: expected key=value")
        out[key.strip()] = value.strip()
    return out


def check_admin_key(key: str) -> str:
    """The key goes into tritonserver's `<apis>:<header>=<key>` option: letters, digits and `._~+/-` only."""
    if not re.fullmatch(r"[A-Za-z0-9._~+/-]+", key or ""):
        raise ServerError("the admin key may hold only letters, digits and . _ ~ + / -")
    return key


def write_admin_key(key: str) -> str:
    """Leave `key` in a new file of `private_dir()` (mode 0600, this user's); returns its path."""
    try:
        directory = private_dir()
    except EngineProcessError as e:
        raise ServerError(str(e)) from None
    path = os.path.join(directory, f"admin-key-{os.getpid()}")
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return path


def _env_tmpdir(env: Mapping[str, str]) -> str:
    """tempfile.gettempdir() as a process with environment `env` finds it (its TMPDIR, TEMP, TMP)."""
    for var in ("TMPDIR", "TEMP", "TMP"):
        if env.get(var) and os.path.isdir(env[var]):
            return os.path.abspath(env[var])
    return tempfile.gettempdir()


def _remove_own(path: str) -> bool:
    """Unlink `path` if it is a file or socket of this user (never follows a link)."""
    try:
        st = os.lstat(path)
        if st.st_uid != os.getuid() or not (stat.S_ISREG(st.st_mode) or stat.S_ISSOCK(st.st_mode)):
            return False
        os.unlink(path)
        return True
    except OSError:
        return False


def _proc_stat(pid: int) -> Optional[tuple[str, int, int, int]]:
    """(state, ppid, start time, process group) of process `pid` from /proc, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rindex(b")") + 2:].split()
    return fields[0].decode(), int(fields[1]), int(fields[19]), int(fields[2])


def _pids() -> list[int]:
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def group_members(pgid: int) -> list[int]:
    """The processes of process group `pgid` that are not zombies (dead ones wait for init to reap them)."""
    return [pid for pid in _pids() if (st := _proc_stat(pid)) is not None and st[3] == pgid and st[0] != "Z"]


def process_argv(pid: int) -> Optional[list[bytes]]:
    """The command line of process `pid` from /proc, or None if it is gone (or not readable)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return None


def child_stubs(server_pid: int) -> dict[int, tuple[int, str]]:
    """The live Python backend stubs of tritonserver `server_pid`: {pid: (start time, model)}, from /proc.
    A stub's argv is `triton_python_backend_stub <repository>/<model>/<version>/model.py <shm region> ...`;
    the engine processes are the stubs' children, not the server's, so they are not here."""
    out = {}
    for entry in _pids():
        st = _proc_stat(entry)
        if st is None or st[1] != server_pid or st[0] == "Z":
            continue
        argv = process_argv(entry)
        if argv is None:
            continue
        if os.path.basename(argv[0].decode(errors="replace")) == STUB:
            parts = Path(argv[1].decode(errors="replace")).parts if len(argv) > 1 else ()
            out[entry] = (st[2], parts[-3] if len(parts) >= 3 else "?")
    return out


def _shm_size() -> Optional[int]:
    try:
        st = os.statvfs(SHM_DIR)
        return st.f_blocks * st.f_frsize or None
    except OSError:
        return None


@functools.lru_cache(maxsize=None)
def private_shm_wrapper() -> tuple[Optional[tuple[str, ...]], str]:
    """(argv prefix that runs a command in a mount namespace of its own with a fresh tmpfs on /dev/shm, the
    size of this one's; None and why when this process cannot). As root: unshare --mount. Otherwise in a
    user namespace (root inside only for the mount, then a nested one maps this uid back), if the kernel
    allows unprivileged user namespaces. The command keeps its pid (unshare and sh exec it). Probed once:
    the probe must see this uid and an empty /dev/shm."""
    unshare, mount = shutil.which("unshare"), shutil.which("mount")
    if not unshare or not mount:
        return None, "no unshare/mount on PATH (util-linux)"
    size = _shm_size()
    opts = "nosuid,nodev,mode=1777" + (f",size={size}" if size else "")
    mount_cmd = f"{mount} -t tmpfs -o {opts} ouro-shm {SHM_DIR}"
    uid, gid = os.getuid(), os.getgid()
    if uid == 0:
        wrapper = (unshare, "--mount", "--propagation", "private", "--", "sh", "-c",
                   f'{mount_cmd} && exec "$@"', "sh")
    else:
        wrapper = (unshare, "--user", "--map-root-user", "--mount", "--propagation", "private", "--", "sh", "-c",
                   f'{mount_cmd} && exec {unshare} --user --map-user={uid} --map-group={gid} -- "$@"', "sh")
    try:
        r = subprocess.run(list(wrapper) + ["sh", "-c", f"id -u; ls -A {SHM_DIR} | wc -l"], capture_output=True,
                           text=True, timeout=20, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"unshare failed: {e}"
    if r.returncode != 0 or r.stdout.split() != [str(uid), "0"]:
        why = (r.stderr.strip().splitlines() or [f"exit code {r.returncode}, output {r.stdout.split()}"])[-1]
        return None, f"no private mount namespace here ({why})"
    return wrapper, ""


class _ShmGuard(threading.Thread):
    """Without a private /dev/shm: chmod 0600 each region named `<prefix>*` as soon as it appears (Triton's
    Python backend makes them 0644 whatever the umask). Polls every 20 ms until `relax()` (the server is
    ready; later regions are rare), then every 0.5 s. A local user who opens a region between its creation
    and the chmod keeps that access: that race is the residual risk."""

    def __init__(self, prefix: str):
        super().__init__(name="ouro-shm-guard", daemon=True)
        self.prefix = prefix
        self.interval = 0.02
        self._stop_event = threading.Event()

    def relax(self) -> None:
        self.interval = 0.5

    def stop(self) -> None:
        self._stop_event.set()

    def run(self) -> None:
        done: set = set()
        while True:
            self.sweep(done)
            if self._stop_event.wait(self.interval):
                return

    def sweep(self, done: set) -> None:
        try:
            names = [n for n in os.listdir(SHM_DIR) if n.startswith(self.prefix) and n not in done]
        except OSError:
            return
        for name in names:
            try:  # through an fd opened without following links: never chmod what a link points to
                fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            except OSError:
                continue
            try:
                st = os.fstat(fd)
                if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid():
                    if st.st_mode & 0o077:
                        os.fchmod(fd, 0o600)
                    done.add(name)
            except OSError:
                pass
            finally:
                os.close(fd)


class TritonServer:
    """A tritonserver process serving the Ouro repository. Use as a context manager or start()/stop().

    Each start() gets a fresh shared-memory region prefix (`shm_prefix`); `pid` stays the last server's pid
    after it is gone, so that cleanup() can remove what it left. stop() and kill() end the whole process
    group (the stubs and engine processes too) and clean up. `admin_key`: keep Triton's shared-memory,
    repository, logging and trace APIs behind the header `ouro-admin-key` (None: open, tritonserver's
    default). `private_shm`: see the module docstring; `shm_private` says what the last start got
    ("namespace" or "chmod") and `shm_why` why not the namespace."""

    def __init__(self, model: Optional[str] = None, http_port: int = 8000, grpc_port: int = 8001,
                 metrics_port: int = 8002, model_repository: Optional[str] = None,
                 engine_args: Optional[Mapping[str, str]] = None, log_file: Optional[str] = None,
                 extra_args: Sequence[str] = (), env: Optional[Mapping[str, str]] = None, log_verbose: int = 0,
                 address: Optional[str] = None, devices: Optional[str] = None, admin_key: Optional[str] = None,
                 private_shm: str = "auto"):
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
        self.shm_private: Optional[str] = None
        self.shm_why = ""
        self.shm_prefix, self._own_shm_prefix = self._new_shm_prefix()
        self.proc: Optional[subprocess.Popen] = None
        self.pid: Optional[int] = None
        self._tmpdir = tempfile.gettempdir()
        self._log_handle = None
        self._guard: Optional[_ShmGuard] = None

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

    def _user_arg(self, option: str) -> Optional[str]:
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
        cmd = [binary, f"--model-repository={self.model_repository}", f"--http-port={self.http_port}",
               f"--grpc-port={self.grpc_port}", f"--metrics-port={self.metrics_port}",
               "--allow-metrics=true", "--allow-gpu-metrics=false"]
        if self.address:
            cmd += [f"--http-address={self.address}", f"--grpc-address={self.address}",
                    f"--metrics-address={self.address}"]
        if backend_dir:
            cmd.append(f"--backend-directory={backend_dir}")
        if self.log_verbose:
            cmd.append(f"--log-verbose={self.log_verbose}")
        if self._own_shm_prefix:
            cmd.append(f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}")
        if self.admin_key:
            # tritonserver refuses an API named in two groups: a user's own option replaces ours.
            for option in ("--http-restricted-api", "--grpc-restricted-protocol"):
                if self._user_arg(option) is None:
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

    def start(self, wait: bool = True, timeout: float = 300.0) -> "TritonServer":
        self.shm_prefix, self._own_shm_prefix = self._new_shm_prefix()
        cmd, env = self.command()
        wrapper, self.shm_why = (None, "--private-shm off") if self.private_shm == "off" else private_shm_wrapper()
        if wrapper is None and self.private_shm == "on":
            raise ServerError(f"--private-shm on: cannot give tritonserver a private /dev/shm: {self.shm_why}")
        self.shm_private = "namespace" if wrapper else "chmod"
        self._tmpdir = _env_tmpdir(env)
        self._log_handle = open(self.log_file, "ab")
        self.proc = subprocess.Popen(list(wrapper or ()) + cmd, stdout=self._log_handle, stderr=subprocess.STDOUT,
                                     env=env, stdin=subprocess.DEVNULL, start_new_session=True, umask=0o077)
        self.pid = self.proc.pid  # tritonserver's own: the wrapper execs it
        if wrapper is None:
            self._guard = _ShmGuard(self.shm_prefix)
            self._guard.start()
        if wait:
            self.wait_ready(timeout)
        return self

    def mark_ready(self) -> None:
        """Readiness seen: the shm guard may poll slowly from now on."""
        if self._guard is not None:
            self._guard.relax()

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise ServerError(f"tritonserver exited with code {self.proc.returncode} before it was ready; "
                                  f"log {self.log_file}:\n{self.log_tail()}")
            if self.is_ready():
                self.mark_ready()
                return
            time.sleep(0.5)
        raise ServerError(f"tritonserver not ready after {timeout:.0f}s; log {self.log_file}:\n{self.log_tail()}")

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
        (engine_process.engine_address / key_path, engine_pool.manifest_path: `engine-<pid>-*` in
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
        return [path for path in self.stale_files() if _remove_own(path)]

    def kill(self) -> Optional[int]:
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

    def stop(self, timeout: float = 60.0, hurry: Optional[threading.Event] = None) -> Optional[int]:
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

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _describe_exit(code: Optional[int]) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"code {code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"code {code}"
    return f"code {code}"


class Supervisor:
    """Keeps `server` serving until request_stop(): starts it, waits for readiness, watches it, and restarts
    it when it dies or one of its Python backend stubs does (see the module docstring). run() returns the
    exit code for ouro-serve: 0 once stopped on request, 1 when the first start fails or after
    `max_failed_starts` failed starts in a row (or, with restart=False, when the server dies).

    Thread-safe to stop from a signal handler or another thread. `restarts` counts restarts so far (each
    server gets it in $OURO_SERVER_RESTARTS); `recoveries` holds, per restart that reached readiness, the
    seconds from noticing the death to ready again; `ready` is set while a server is ready."""

    def __init__(self, server: TritonServer, ready_timeout: float = 600.0, max_failed_starts: int = 5,
                 backoff_s: float = 1.0, max_backoff_s: float = 30.0, stable_s: float = 60.0,
                 stop_grace_s: float = 10.0, restart: bool = True, poll_s: float = 0.5,
                 on_ready: Optional[Callable[["Supervisor"], None]] = None,
                 log: Callable[[str], None] = lambda text: print(text, file=sys.stderr, flush=True)):
        self.server = server
        self.ready_timeout, self.max_failed_starts = ready_timeout, max(1, max_failed_starts)
        self.backoff_s, self.max_backoff_s, self.stable_s = backoff_s, max_backoff_s, stable_s
        self.stop_grace_s, self.restart, self.poll_s = stop_grace_s, restart, poll_s
        self.on_ready, self.log = on_ready, log
        self.restarts = 0
        self.recoveries: list[float] = []
        self.ready = threading.Event()
        self._stop = threading.Event()
        self._hurry = threading.Event()
        self.stop_reason = ""
        # Under model control (explicit/poll) a stub may go away because its model was unloaded.
        mode = server._user_arg("--model-control-mode")
        self.watch_stubs = mode in (None, "none")

    def request_stop(self, reason: str = "") -> None:
        """Stop gracefully; a second call kills the server without waiting for the grace. Safe in a signal
        handler (it only sets events: run() says `reason`)."""
        if self._stop.is_set():
            self._hurry.set()
        self.stop_reason = self.stop_reason or reason
        self._stop.set()

    def _wait_ready(self) -> Optional[str]:
        """None once ready (or stopping); else why the start failed."""
        deadline = time.monotonic() + self.ready_timeout
        proc = self.server.proc
        while not self._stop.is_set():
            if proc.poll() is not None:
                return f"tritonserver exited with {_describe_exit(proc.returncode)} before it was ready"
            if self.server.is_ready():
                self.server.mark_ready()
                return None
            if time.monotonic() > deadline:
                return f"tritonserver not ready after {self.ready_timeout:.0f} s"
            self._stop.wait(0.25)
        return None

    def _watch(self) -> Optional[str]:
        """Block while the ready server lives; why it is dead (None: stop requested)."""
        proc = self.server.proc
        stubs = self.server.stubs() if self.watch_stubs else {}
        while not self._stop.wait(self.poll_s):
            if proc.poll() is not None:
                return f"tritonserver (pid {proc.pid}) exited with {_describe_exit(proc.returncode)}"
            if not stubs:
                continue
            now = child_stubs(proc.pid)
            if proc.poll() is not None:  # its stubs go with it: that is the exit above
                continue
            dead = [(pid, model) for pid, (start, model) in stubs.items() if now.get(pid, (None,))[0] != start]
            if dead:
                pid, model = dead[0]
                return (f"the Python backend stub of model '{model}' (pid {pid}) died; tritonserver (pid "
                        f"{proc.pid}) does not restart it and cannot serve that model instance")
            stubs.update(now)
        return None

    def run(self) -> int:
        try:
            return self._run()
        except BaseException:
            self.server.kill()  # never leave a server behind
            raise

    def _run(self) -> int:
        failed, backoff, served = 0, self.backoff_s, False
        down_at: Optional[float] = None
        while not self._stop.is_set():
            self.server.extra_env[RESTARTS_ENV] = str(self.restarts)
            try:
                self.server.start(wait=False)
            except (ServerError, OSError) as e:
                self.log(f"ouro-serve: {e}")
                self.server.kill()
                return 1
            why = self._wait_ready()
            if self._stop.is_set():
                break
            if why is not None:
                failed += 1
                self.server.kill()
                tail = self.server.log_tail()
                if not served:  # never served: the configuration, not a crash
                    self.log(f"ouro-serve: {why}; log {self.server.log_file}:\n{tail}")
                    return 1
                if failed >= self.max_failed_starts or not self.restart:
                    self.log(f"ouro-serve: {why}; log {self.server.log_file}:\n{tail}\nouro-serve: giving up: "
                             f"{failed} restart(s) in a row did not reach readiness (--max-failed-starts)")
                    return 1
                self.log(f"ouro-serve: {why} (failed start {failed} of at most {self.max_failed_starts}); "
                         f"restart {self.restarts + 1} in {backoff:.0f} s; log {self.server.log_file}:\n{tail}")
            else:
                served, failed = True, 0
                ready_at = time.monotonic()
                if down_at is not None:
                    self.recoveries.append(ready_at - down_at)
                self.ready.set()
                if self.on_ready is not None:
                    self.on_ready(self)
                why = self._watch()
                self.ready.clear()
                if why is None:
                    break
                down_at = time.monotonic()
                code = self.server.kill()
                tail = self.server.log_tail()
                self.server.note(f"{why}; killed its process group (exit {_describe_exit(code)}), removed its files")
                if not self.restart:
                    self.log(f"ouro-serve: {why}; log {self.server.log_file}:\n{tail}")
                    return 1
                if time.monotonic() - ready_at >= self.stable_s:
                    backoff = self.backoff_s
                self.log(f"ouro-serve: {why}; restart {self.restarts + 1} in {backoff:.0f} s; "
                         f"log {self.server.log_file}:\n{tail}")
            self.restarts += 1
            delay, backoff = backoff, min(backoff * 2, self.max_backoff_s)
            if self._stop.wait(delay):
                break
            self.server.note(f"restart {self.restarts}")
        self.ready.clear()
        if self.stop_reason:
            self.log(f"ouro-serve: {self.stop_reason}: stopping tritonserver")
        code = self.server.stop(self.stop_grace_s, self._hurry)
        if code not in (0, None):
            self.log(f"ouro-serve: tritonserver ended with {_describe_exit(code)} while stopping")
        return 0


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="ouro-serve", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--model", default=None, help="checkpoint directory (default: $OURO_MODEL_PATH, else the demo model)")
    p.add_argument("--address", default="0.0.0.0",
                   help="interface the HTTP, gRPC and metrics ports bind to (127.0.0.1: this host only)")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--model-repository", default=None,
                   help=f"default: ${REPOSITORY_ENV}, else {DEFAULT_REPOSITORY}")
    p.add_argument("--devices", default="auto",
                   help="one engine process per device, comma-separated (cuda:0,cuda:1 or cpu); auto: every "
                        "visible GPU (CUDA_VISIBLE_DEVICES), else the CPU; overrides ouro_engine's engine_devices")
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="engine option (ouro_backend/config.py EngineConfig), repeatable; overrides config.pbtxt")
    p.add_argument("--log-file", default=None, help="server log (default: a file in a new temp dir)")
    p.add_argument("--log-verbose", type=int, default=0, help="tritonserver --log-verbose level")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for readiness (each start)")
    p.add_argument("--tritonserver-arg", action="append", default=[], metavar="ARG",
                   help="extra tritonserver argument, repeatable (e.g. --tritonserver-arg=--log-info=false)")
    p.add_argument("--private-shm", choices=PRIVATE_SHM_MODES, default="auto",
                   help="on: tritonserver in a mount namespace with its own /dev/shm; off: chmod 0600 its "
                        "shared-memory regions as they appear; auto: on when possible (default)")
    p.add_argument("--admin-key", default=None,
                   help=f"the `{ADMIN_HEADER}` header value that the shared-memory, repository, logging and trace "
                        f"APIs need (default: ${ADMIN_KEY_ENV}, else a random key in a private file)")
    p.add_argument("--no-restrict-apis", action="store_true",
                   help="leave every Triton API open to whoever reaches the ports (tritonserver's default)")
    p.add_argument("--max-failed-starts", type=int, default=5,
                   help="give up after this many restarts in a row that do not reach readiness")
    p.add_argument("--no-restart", action="store_true", help="exit (code 1) when tritonserver dies")
    p.add_argument("--stop-grace", type=float, default=10.0,
                   help="seconds Triton gets to shut down gracefully on Ctrl-C / SIGTERM before it is killed")
    args = p.parse_args(argv)

    key_file = None
    try:
        engine_args = parse_engine_args(args.engine_arg)
        from ..config import ConfigError, EngineConfig

        try:  # fail fast, before the server and its models start
            config = EngineConfig.from_strings({k: v for k, v in engine_args.items() if k != "model"})
        except ConfigError as e:
            print(f"ouro-serve: bad --engine-arg: {e}", file=sys.stderr)
            return 2
        try:
            devices = resolve_devices(args.devices, config.device)
        except ConfigError as e:
            print(f"ouro-serve: bad --devices: {e}", file=sys.stderr)
            return 2
        repository = Path(args.model_repository or default_repository())
        if not (repository / "ouro_engine" / "config.pbtxt").is_file():
            print(f"ouro-serve: {repository} is not the Ouro model repository (no ouro_engine/config.pbtxt); "
                  f"pass --model-repository or set ${REPOSITORY_ENV}", file=sys.stderr)
            return 2
        model = args.model or os.environ.get("OURO_MODEL_PATH")
        if model and not Path(model).expanduser().is_dir():
            print(f"ouro-serve: --model {model}: no such directory", file=sys.stderr)
            return 2
        admin_key, admin = None, "open to all (--no-restrict-apis)"
        if not args.no_restrict_apis:
            admin_key = args.admin_key or os.environ.get(ADMIN_KEY_ENV) or None
            if admin_key:
                admin = f"the key from {'--admin-key' if args.admin_key else '$' + ADMIN_KEY_ENV}"
                check_admin_key(admin_key)
            else:
                admin_key = secrets.token_urlsafe(32)
                key_file = write_admin_key(admin_key)
                admin = f"the key in {key_file}"
            admin = f"need header {ADMIN_HEADER}: {admin}"
        if not model:
            from ..models import default_model

            model = default_model()
            print(f"ouro-serve: no --model given: serving the demo model {model}", flush=True)
        server = TritonServer(model=model, http_port=args.http_port, grpc_port=args.grpc_port,
                              metrics_port=args.metrics_port, model_repository=str(repository),
                              engine_args=engine_args, log_file=args.log_file, extra_args=args.tritonserver_arg,
                              log_verbose=args.log_verbose, address=args.address, devices=args.devices,
                              admin_key=admin_key, private_shm=args.private_shm)
        cmd, _ = server.command()
    except ServerError as e:
        print(f"ouro-serve: {e}", file=sys.stderr)
        if key_file:
            _remove_own(key_file)
        return 2

    def on_ready(sup: Supervisor) -> None:
        if sup.restarts:
            print(f"ouro-serve: ready again (restart {sup.restarts}, {sup.recoveries[-1]:.1f} s after the crash; "
                  f"tritonserver pid {server.pid})", flush=True)
            return
        if server.shm_private == "namespace":
            shm = "a private /dev/shm (mount namespace)"
        else:
            shm = f"regions chmod 0600 as they appear ({server.shm_why or 'no namespace'})"
            print("ouro-serve: warning: no private /dev/shm for tritonserver: a local user who opens a shared-"
                  "memory region before it is chmod 0600 (polled every 20 ms) keeps access to it", file=sys.stderr,
                  flush=True)
        print(f"ouro-serve: ready (tritonserver pid {server.pid}; listening on {args.address}"
              f"{': every interface' if args.address == '0.0.0.0' else ''})\n"
              f"  HTTP     http://{server.http_url}  (POST /v2/models/ouro/generate, /generate_stream)\n"
              f"  gRPC     {server.grpc_url}  (ModelStreamInfer: models ouro, ouro_ensemble, ouro_engine)\n"
              f"  metrics  {server.metrics_url}\n"
              f"  admin    shared-memory, repository, logging and trace APIs {admin}\n"
              f"  shm      {shm}\n"
              f"  Ctrl-C to stop", flush=True)

    supervisor = Supervisor(server, ready_timeout=args.timeout, max_failed_starts=args.max_failed_starts,
                            stop_grace_s=args.stop_grace, restart=not args.no_restart, on_ready=on_ready)

    def on_signal(signum, frame):
        supervisor.request_stop(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    gpus = visible_gpus()
    where = ", ".join(d if d == "cpu" else f"{d} (GPU {gpus[int(d[5:])]})" for d in devices)
    print(f"ouro-serve: starting {cmd[0]}\n  repository {server.model_repository}\n  log {server.log_file}\n"
          f"  engines  {len(devices)}: {where}"
          + (" (every visible GPU; --devices to choose)" if args.devices == "auto" and devices != ["cpu"] else ""),
          flush=True)
    try:
        code = supervisor.run()
    finally:
        if key_file:
            _remove_own(key_file)
    if code == 0:
        print(f"ouro-serve: stopped; log {server.log_file}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
