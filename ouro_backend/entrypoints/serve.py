"""`ouro-serve`: start Triton Inference Server on the Ouro model repository.

    ouro-serve [--model DIR] [--address 0.0.0.0] [--http-port 8000] [--grpc-port 8001] [--metrics-port 8002]
               [--devices auto|cuda:0,cuda:1|cpu] [--engine-arg key=value ...] [--model-repository DIR]
               [--log-file PATH] [--log-verbose N]

Devices: one engine process per device, each request to the least loaded; by default every GPU that
CUDA_VISIBLE_DEVICES leaves visible (else the CPU). Said at start.

Network exposure: HTTP, gRPC and metrics bind to --address, by default 0.0.0.0 (every interface, as
tritonserver does): anyone who can reach the ports can run inference, cancel nothing of others, and read
the metrics. Use --address 127.0.0.1 to serve this host only (behind a proxy), and for production see
tritonserver's --http-restricted-api / --grpc-restricted-api (pass them with --tritonserver-arg) to
keep the model-control, repository and shared-memory APIs behind a header key. The engine process is
reached only through a Unix socket in a directory private to this user, with a per-server key.

Which server: `$TRITONSERVER` or `tritonserver` on PATH (the NGC container), else the Triton 2.51 server
inside the `nvidia-pytriton` wheel, prepared to run outside a container: the Python
backend (library + the stub built for this Python) is copied into a writable cache dir
($OURO_CACHE_DIR or ~/.cache/ouro-triton/tritonserver-backends), LD_LIBRARY_PATH gets the wheel's
`nvidia_pytriton.libs`, and this interpreter's bin dir goes first on PATH (the stub finds its packages
through the `python3` on PATH; numpy must be < 2 there).

The checkpoint reaches the models through $OURO_MODEL_PATH (`--model`; default: the demo model shipped
with the package) and extra engine options through $OURO_ENGINE_ARGS (`--engine-arg`), which override
the `parameters` of ouro_engine/config.pbtxt. Engine args are validated before the server starts.

The server's output goes to a log file (printed at start; its tail is printed if the server fails).
Ctrl-C / SIGTERM stop the server.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Mapping, Optional, Sequence

from ..serving.engine_pool import resolve_devices, visible_gpus
from ..serving.options import DEVICES_ENV

ROOT = Path(__file__).resolve().parents[1]
REPOSITORY_ENV = "OURO_MODEL_REPOSITORY"


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


class TritonServer:
    """A tritonserver process serving the Ouro repository. Use as a context manager or start()/stop()."""

    def __init__(self, model: Optional[str] = None, http_port: int = 8000, grpc_port: int = 8001,
                 metrics_port: int = 8002, model_repository: Optional[str] = None,
                 engine_args: Optional[Mapping[str, str]] = None, log_file: Optional[str] = None,
                 extra_args: Sequence[str] = (), env: Optional[Mapping[str, str]] = None, log_verbose: int = 0,
                 address: Optional[str] = None, devices: Optional[str] = None):
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
        self.proc: Optional[subprocess.Popen] = None
        self._log_handle = None

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
        cmd, env = self.command()
        self._log_handle = open(self.log_file, "ab")
        self.proc = subprocess.Popen(cmd, stdout=self._log_handle, stderr=subprocess.STDOUT, env=env,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        if wait:
            self.wait_ready(timeout)
        return self

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
                return
            time.sleep(0.5)
        raise ServerError(f"tritonserver not ready after {timeout:.0f}s; log {self.log_file}:\n{self.log_tail()}")

    def log_text(self) -> str:
        try:
            return Path(self.log_file).read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def stop(self, timeout: float = 60.0) -> Optional[int]:
        proc, self.proc = self.proc, None
        code = None
        if proc is not None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)  # Triton's graceful shutdown (unloads models, finalize())
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
            code = proc.returncode
            # Python backend stubs live in the server's process group (start_new_session): if the server
            # died without stopping them (a crash), they would linger; end what is left of the group.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self._log_handle is not None:
            self._log_handle.close()
            self._log_handle = None
        return code

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


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
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for readiness")
    p.add_argument("--tritonserver-arg", action="append", default=[], metavar="ARG",
                   help="extra tritonserver argument, repeatable (e.g. --tritonserver-arg=--log-info=false)")
    args = p.parse_args(argv)

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
        if not model:
            from ..models import default_model

            model = default_model()
            print(f"ouro-serve: no --model given: serving the demo model {model}", flush=True)
        server = TritonServer(model=model, http_port=args.http_port, grpc_port=args.grpc_port,
                              metrics_port=args.metrics_port, model_repository=str(repository),
                              engine_args=engine_args, log_file=args.log_file, extra_args=args.tritonserver_arg,
                              log_verbose=args.log_verbose, address=args.address, devices=args.devices)
        cmd, _ = server.command()
    except ServerError as e:
        print(f"ouro-serve: {e}", file=sys.stderr)
        return 2

    stopping = {"signal": None}

    def on_signal(signum, frame):
        stopping["signal"] = signum
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    gpus = visible_gpus()
    where = ", ".join(d if d == "cpu" else f"{d} (GPU {gpus[int(d[5:])]})" for d in devices)
    print(f"ouro-serve: starting {cmd[0]}\n  repository {server.model_repository}\n  log {server.log_file}\n"
          f"  engines  {len(devices)}: {where}"
          + (" (every visible GPU; --devices to choose)" if args.devices == "auto" and devices != ["cpu"] else ""),
          flush=True)
    try:
        server.start(wait=False)
        server.wait_ready(args.timeout)
        print(f"ouro-serve: ready (listening on {args.address}{': every interface' if args.address == '0.0.0.0' else ''})\n"
              f"  HTTP     http://{server.http_url}  (POST /v2/models/ouro/generate, /generate_stream)\n"
              f"  gRPC     {server.grpc_url}  (ModelStreamInfer: models ouro, ouro_ensemble, ouro_engine)\n"
              f"  metrics  {server.metrics_url}\n"
              f"  Ctrl-C to stop", flush=True)
        while server.proc is not None and server.proc.poll() is None:
            time.sleep(0.5)
        code = server.proc.returncode if server.proc is not None else 1
        print(f"ouro-serve: tritonserver exited with code {code}; log {server.log_file}:\n{server.log_tail()}",
              file=sys.stderr)
        server.stop()
        return code or 1
    except ServerError as e:
        server.stop()
        print(f"ouro-serve: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("ouro-serve: stopping tritonserver", flush=True)
        code = server.stop()
        print(f"ouro-serve: stopped (exit code {code}); log {server.log_file}", flush=True)
        return 0


if __name__ == "__main__":
    sys.exit(main())
