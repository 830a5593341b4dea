"""`ouro-serve`: start Triton Inference Server on the Ouro model repository, and keep it serving.

    ouro-serve [--model DIR] [--address 0.0.0.0] [--http-port 8000] [--grpc-port 8001] [--metrics-port 8002]
               [--openai-port N]
               [--devices auto|cuda:0,cuda:1|cpu] [--engine-arg key=value ...] [--model-repository DIR]
               [--log-file PATH] [--log-verbose N] [--private-shm auto|on|off] [--admin-key KEY]
               [--no-restrict-apis] [--max-failed-starts N] [--no-restart] [--stop-grace S]

OpenAI-compatible API: with --openai-port N (default: not served), /v1/completions, /v1/chat/completions,
/v1/models and /health on port N at --address (ouro_backend/entrypoints/openai_api.py, a process of its own
in front of the `ouro` model over gRPC). It starts with ouro-serve, which says "ready" once it answers too;
it is started again if it dies, stopped with ouro-serve, and gets SIGTERM if ouro-serve is killed. A port
in use fails the start as tritonserver's do.

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

Ports: a port that another process listens on (say a second ouro-serve on the same ports) fails the start
at once, exit code 1, with a message naming the port and the process; readiness counts only the answers of
this ouro-serve's own tritonserver. GPU engines turn on Triton's GPU metrics (nv_gpu_*).

The server's output goes to a log file (printed at start; its tail is printed if the server fails; every
restart appends to it). Ctrl-C / SIGTERM / SIGHUP stop the server: Triton's graceful shutdown, killed after
--stop-grace seconds (10; a second Ctrl-C kills at once); exit code 0. Every exit removes what this
ouro-serve and its servers left in the engine sockets' directory (engine sockets, keys, manifests, the admin
key file); if ouro-serve itself is killed (SIGKILL), tritonserver gets SIGTERM (where util-linux's setpriv
is found) and its graceful shutdown removes the engine's files.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from ..serving.engine_auth import private_dir
from ..serving.engine_errors import EngineProcessError
from ..serving.engine_pool import resolve_devices, visible_gpus
from .openai_process import OpenAIServer, check_openai
from .private_shm import PRIVATE_SHM_MODES
from .supervisor import Supervisor
from .tritonserver import (
    ADMIN_HEADER,
    REPOSITORY_ENV,
    ServerError,
    TritonServer,
    check_admin_key,
    default_repository,
    remove_own,
)

ADMIN_KEY_ENV = "OURO_ADMIN_KEY"
MODEL_ENV = "OURO_MODEL_PATH"
DEFAULT_REPOSITORY = default_repository()
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # SIGHUP: the terminal went away


def resolve_model(arg: str | None, environ: Mapping[str, str] = os.environ) -> tuple[str, bool]:
    """(checkpoint directory to serve, whether it is the demo model): `--model`, else $OURO_MODEL_PATH, else
    the demo model shipped inside the package. ServerError when the one given is no directory."""
    model = arg or environ.get(MODEL_ENV) or None
    if model:
        if not Path(model).expanduser().is_dir():
            raise ServerError(f"{'--model' if arg else '$' + MODEL_ENV} {model}: no such directory")
        return model, False
    from ..models import default_model

    try:
        return default_model(), True
    except FileNotFoundError as e:
        raise ServerError(str(e)) from None


def parse_engine_args(items: Sequence[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ServerError(f"--engine-arg {item!r}: expected key=value")
        out[key.strip()] = value.strip()
    return out


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="ouro-serve",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument(
        "--model", default=None, help="checkpoint directory (default: $OURO_MODEL_PATH, else the demo model)"
    )
    p.add_argument(
        "--address",
        default="0.0.0.0",
        help="interface the HTTP, gRPC and metrics ports bind to (127.0.0.1: this host only)",
    )
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument(
        "--openai-port",
        type=int,
        default=None,
        help="also serve the OpenAI-compatible API (/v1/completions, /v1/chat/completions, /v1/models) on this "
        "port, bound to --address (default: not served)",
    )
    p.add_argument("--model-repository", default=None, help=f"default: ${REPOSITORY_ENV}, else {DEFAULT_REPOSITORY}")
    p.add_argument(
        "--devices",
        default="auto",
        help="one engine process per device, comma-separated (cuda:0,cuda:1 or cpu); auto: every "
        "visible GPU (CUDA_VISIBLE_DEVICES), else the CPU; overrides ouro_engine's engine_devices",
    )
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="engine option (ouro_backend/config.py EngineConfig), repeatable; overrides config.pbtxt",
    )
    p.add_argument("--log-file", default=None, help="server log (default: a file in a new temp dir)")
    p.add_argument("--log-verbose", type=int, default=0, help="tritonserver --log-verbose level")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for readiness (each start)")
    p.add_argument(
        "--tritonserver-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra tritonserver argument, repeatable (e.g. --tritonserver-arg=--log-info=false)",
    )
    p.add_argument(
        "--private-shm",
        choices=PRIVATE_SHM_MODES,
        default="auto",
        help="on: tritonserver in a mount namespace with its own /dev/shm; off: chmod 0600 its "
        "shared-memory regions as they appear; auto: on when possible (default)",
    )
    p.add_argument(
        "--admin-key",
        default=None,
        help=f"the `{ADMIN_HEADER}` header value that the shared-memory, repository, logging and trace "
        f"APIs need (default: ${ADMIN_KEY_ENV}, else a random key in a private file)",
    )
    p.add_argument(
        "--no-restrict-apis",
        action="store_true",
        help="leave every Triton API open to whoever reaches the ports (tritonserver's default)",
    )
    p.add_argument(
        "--max-failed-starts",
        type=int,
        default=5,
        help="give up after this many restarts in a row that do not reach readiness",
    )
    p.add_argument("--no-restart", action="store_true", help="exit (code 1) when tritonserver dies")
    p.add_argument(
        "--stop-grace",
        type=float,
        default=10.0,
        help="seconds Triton gets to shut down gracefully on Ctrl-C / SIGTERM before it is killed",
    )
    args = p.parse_args(argv)

    for signum in STOP_SIGNALS:  # until the supervisor takes them over (_serve)
        signal.signal(signum, _exit_on_signal)
    key_file = None
    try:
        engine_args = parse_engine_args(args.engine_arg)
        from ..config import ConfigError, EngineConfig
        from ..serving.options import SERVING_KEYS, ServingOptions, typed_options

        try:  # fail fast, before the server and its models start; serving-layer keys (stream_interval...) apart
            config = EngineConfig.from_strings(
                {k: v for k, v in engine_args.items() if k != "model" and k not in SERVING_KEYS}
            )
            typed_options(ServingOptions, {k: v for k, v in engine_args.items() if k in SERVING_KEYS})
        except (ConfigError, ValueError) as e:
            print(f"ouro-serve: bad --engine-arg: {e}", file=sys.stderr)
            return 2
        try:
            devices = resolve_devices(args.devices, config.device)
        except ConfigError as e:
            print(f"ouro-serve: bad --devices: {e}", file=sys.stderr)
            return 2
        repository = Path(args.model_repository or default_repository())
        if not (repository / "ouro_engine" / "config.pbtxt").is_file():
            print(
                f"ouro-serve: {repository} is not the Ouro model repository (no ouro_engine/config.pbtxt); "
                f"pass --model-repository or set ${REPOSITORY_ENV}",
                file=sys.stderr,
            )
            return 2
        model, demo = resolve_model(args.model)
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
        if demo:
            print(f"ouro-serve: no --model given: serving the demo model {model}", flush=True)
        server = TritonServer(
            model=model,
            http_port=args.http_port,
            grpc_port=args.grpc_port,
            metrics_port=args.metrics_port,
            model_repository=str(repository),
            engine_args=engine_args,
            log_file=args.log_file,
            extra_args=args.tritonserver_arg,
            log_verbose=args.log_verbose,
            address=args.address,
            devices=args.devices,
            admin_key=admin_key,
            private_shm=args.private_shm,
            gpu_metrics=any(d != "cpu" for d in devices),
        )
        cmd, _ = server.command()
    except ServerError as e:
        print(f"ouro-serve: {e}", file=sys.stderr)
        if key_file:
            remove_own(key_file)
        return 2
    except BaseException:
        if key_file:
            remove_own(key_file)
        raise
    try:
        return _serve(args, server, cmd, devices, admin)
    finally:  # every way out, an exception included (the supervisor has removed the servers' files)
        if key_file:
            remove_own(key_file)


def _exit_on_signal(signum, frame):
    """A stop signal before the supervisor runs: leave through main()'s cleanup (exit code 128 + signal)."""
    raise SystemExit(128 + signum)


def _serve(args: argparse.Namespace, server: TritonServer, cmd: list[str], devices: list[str], admin: str) -> int:
    """Run `server` under a Supervisor until a stop signal; ouro-serve's exit code."""

    failed: list[str] = []  # why ouro-serve stops on its own after a start (the OpenAI API did not come up)
    openai: OpenAIServer | None = None  # with --openai-port, started below (the handlers read it)

    def on_ready(sup: Supervisor) -> None:
        if openai is not None and not sup.restarts:  # "ready" once every endpoint answers
            try:
                openai.wait_answering()
            except ServerError as e:
                failed.append(str(e))
                sup.request_stop("the OpenAI API did not start")
                return
        if sup.restarts:
            print(
                f"ouro-serve: ready again (restart {sup.restarts}, {sup.recoveries[-1]:.1f} s after the crash; "
                f"tritonserver pid {server.pid})",
                flush=True,
            )
            return
        if server.shm_private == "namespace":
            shm = "a private /dev/shm (mount namespace)"
        else:
            shm = f"regions chmod 0600 as they appear ({server.shm_why or 'no namespace'})"
            print(
                "ouro-serve: warning: no private /dev/shm for tritonserver: a local user who opens a shared-"
                "memory region before it is chmod 0600 (polled every 20 ms) keeps access to it",
                file=sys.stderr,
                flush=True,
            )
        print(
            f"ouro-serve: ready (tritonserver pid {server.pid}; listening on {args.address}"
            f"{': every interface' if args.address == '0.0.0.0' else ''})\n"
            f"  HTTP     http://{server.http_url}  (POST /v2/models/ouro/generate, /generate_stream)\n"
            f"  gRPC     {server.grpc_url}  (ModelStreamInfer: models ouro, ouro_ensemble, ouro_engine)\n"
            f"  metrics  {server.metrics_url}\n"
            + (f"  OpenAI   http://{openai.url}/v1  (completions, chat/completions, models)\n" if openai else "")
            + f"  admin    shared-memory, repository, logging and trace APIs {admin}\n"
            f"  shm      {shm}\n"
            f"  Ctrl-C to stop",
            flush=True,
        )

    supervisor = Supervisor(
        server,
        ready_timeout=args.timeout,
        max_failed_starts=args.max_failed_starts,
        stop_grace_s=args.stop_grace,
        restart=not args.no_restart,
        on_ready=on_ready,
    )

    def on_signal(signum, frame):
        supervisor.request_stop(signal.Signals(signum).name)
        if openai is not None:  # the front door closes first, while tritonserver shuts down
            openai.begin_stop()

    for signum in STOP_SIGNALS:
        signal.signal(signum, on_signal)
    try:  # a port in use fails before anything starts (the supervisor's starts check again)
        server.check_ports()
        if args.openai_port is not None:
            check_openai(server, args.openai_port)
    except ServerError as e:
        print(f"ouro-serve: {e}", file=sys.stderr, flush=True)
        return 1
    gpus = visible_gpus()
    where = ", ".join(d if d == "cpu" else f"{d} (GPU {gpus[int(d[5:])]})" for d in devices)
    print(
        f"ouro-serve: starting {cmd[0]}\n  repository {server.model_repository}\n  log {server.log_file}\n"
        f"  engines  {len(devices)}: {where}"
        + (" (every visible GPU; --devices to choose)" if args.devices == "auto" and devices != ["cpu"] else ""),
        flush=True,
    )
    if args.openai_port is not None:  # it starts while tritonserver loads; on_ready waits for it
        openai = OpenAIServer(server, args.address, args.openai_port)
    try:
        code = supervisor.run()
    finally:
        if openai is not None:
            openai.stop()
    if failed:
        print(f"ouro-serve: {failed[0]}", file=sys.stderr, flush=True)
        return 1
    if code == 0:
        print(f"ouro-serve: stopped; log {server.log_file}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
