"""Shared fixtures, and the test tiers (markers registered in pyproject.toml):

* ``unit``: model-free and fast (the whole tier runs in seconds): no checkpoint, no model, no forward, no
  server. The engine-core pieces built alone (tests/test_unit_*.py: block pool, KV cache, scheduler,
  sequence and stop strings, decode state), and test_streams.py, test_serving_unit.py,
  test_package_layers.py, test_exit_policy.py. A test of those modules that asks for a model fixture
  (toy_path, toy_weights, oracle, llm, server, demo_server) is ``engine`` instead (test_exit_policy.py's
  engine runs).
* ``server``: starts a real tritonserver (ouro-serve / TritonServer): test_server*.py and SERVER_MODULES
  (whole modules, by their main subject), any test that asks for the ``server`` or ``demo_server``
  fixture, and the two served tests of engine modules in SERVER_TESTS.
* ``gpu``: test_gpu.py (skipped without CUDA).
* ``engine``: everything else, and so any new module by default: the engine or a model on CPU.

Each test gets exactly one tier; a tier marker written on a test or module by hand wins. Run one with
``pytest -m unit`` (or ``-m "not server and not gpu"``).
"""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TIERS = ("unit", "engine", "server", "gpu")
UNIT_MODULES = {"test_streams.py", "test_serving_unit.py", "test_package_layers.py", "test_exit_policy.py"}
UNIT_PREFIXES = ("test_unit_", "test_core_units")
SERVER_MODULES = {
    "test_hardening.py",
    "test_supervisor.py",
    "test_soak.py",
    "test_genai_perf.py",
    "test_aiperf.py",
    "test_openai_api.py",
}
SERVER_PREFIXES = ("test_server",)
GPU_MODULES = {"test_gpu.py"}
# Tests of engine modules that start a tritonserver themselves (module file name::function name).
SERVER_TESTS = {
    "test_demo_model.py::test_ouro_serve_without_a_model_serves_the_demo_model",
    "test_speculation.py::test_served_speculation_text_equals_plain_and_metrics_show_acceptance",
}
MODEL_FIXTURES = {"toy_path", "toy_weights", "oracle", "llm", "server", "demo_server"}
SERVER_FIXTURES = {"server", "demo_server"}


def tier_of(item) -> str:
    """The tier of one collected test (see the module docstring)."""
    module = item.path.name
    fixtures = set(getattr(item, "fixturenames", ()))
    if f"{module}::{item.originalname}" in SERVER_TESTS or fixtures & SERVER_FIXTURES:
        return "server"
    if module in UNIT_MODULES or module.startswith(UNIT_PREFIXES):
        return "engine" if fixtures & MODEL_FIXTURES else "unit"
    if module in SERVER_MODULES or module.startswith(SERVER_PREFIXES):
        return "server"
    if module in GPU_MODULES:
        return "gpu"
    return "engine"


def pytest_collection_modifyitems(config, items):
    for item in items:
        if not any(item.get_closest_marker(t) for t in TIERS):
            item.add_marker(getattr(pytest.mark, tier_of(item)))


@pytest.fixture(scope="session", autouse=True)
def socket_dir_left_empty(tmp_path_factory):
    """A TMPDIR of the session's own (under pytest's basetemp, inherited by every server, stub and engine
    process the tests start), so that the engine sockets' directory `$TMPDIR/ouro-triton-<uid>` holds only
    what this session makes, whatever else runs on the host; after the last test it must be empty: no
    engine socket, key, manifest or admin key file left behind by a server, an engine or ouro-serve."""
    import tempfile

    root = tmp_path_factory.getbasetemp() / "tmp"
    root.mkdir(mode=0o700, exist_ok=True)
    saved = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(root)
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    try:
        yield root
    finally:
        if saved is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved
        tempfile.tempdir = None
    directory = root / f"ouro-triton-{os.getuid()}"
    left = sorted(os.listdir(directory)) if directory.is_dir() else []
    assert not left, f"the tests left these in the engine sockets' directory {directory}: {left}"


@pytest.fixture(scope="session")
def toy_path(tmp_path_factory) -> str:
    """A fresh toy checkpoint, written by exactly the command users run."""
    import subprocess

    out = tmp_path_factory.mktemp("toy") / "ckpt"
    subprocess.run(
        [sys.executable, "-m", "ouro_backend.model.toy", "--out", str(out)],
        check=True,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
    )
    return str(out)


@pytest.fixture(scope="session")
def toy_weights(toy_path):
    import torch

    from ouro_backend.model.checkpoint import load_config, load_weights

    cfg = load_config(toy_path)
    return cfg, load_weights(toy_path, cfg, torch.float32, "cpu")


@pytest.fixture(scope="session")
def oracle(toy_weights):
    from ouro_backend.model.oracle import DenseOracle

    return DenseOracle(*toy_weights)


def _serve(srv, request):
    """Start a TritonServer, yield it, and check its shutdown: exit code 0, no Python traceback in the log
    (its log path is printed at start, its tail after a failure)."""
    from server_common import START_TIMEOUT_S

    from ouro_backend.entrypoints.tritonserver import ServerError

    print(f"\ntritonserver log: {srv.log_file}", flush=True)
    try:
        srv.start(timeout=START_TIMEOUT_S)
    except ServerError:
        srv.stop()
        raise
    failed_before = request.session.testsfailed
    try:
        yield srv
    finally:
        code = srv.stop()
        log = srv.log_text()
        if request.session.testsfailed > failed_before:
            print(f"\n--- tritonserver log tail ({srv.log_file}) ---\n{srv.log_tail(100)}")
        if "Traceback" in log:
            print(srv.log_tail(120))
        assert "Traceback" not in log, f"Python error in the server log {srv.log_file}"
        assert code == 0, f"tritonserver exit code {code}; log {srv.log_file}:\n{srv.log_tail()}"


@pytest.fixture(scope="session")
def server(toy_path, request):
    """One real tritonserver (the launcher's TritonServer, this host only) on the toy checkpoint for every
    module that asks for `server` (tests/test_server_*.py, test_genai_perf.py); modules that need a server
    of their own define their own fixture."""
    from server_common import ENGINE_ARGS, server_or_skip

    yield from _serve(server_or_skip(model=toy_path, engine_args=ENGINE_ARGS, address="127.0.0.1"), request)


@pytest.fixture(scope="session")
def demo_server(request):
    """A real tritonserver on the default model, the shipped demo model (what `ouro-serve` serves without
    --model), for the client tools that must agree with the served model (its tokenizer) or need a model
    whose requests take realistic time (tests/test_client_tools.py, test_genai_perf.py)."""
    from server_common import ENGINE_ARGS, server_or_skip

    from ouro_backend.models import default_model

    yield from _serve(server_or_skip(model=default_model(), engine_args=ENGINE_ARGS, address="127.0.0.1"), request)


@pytest.fixture(scope="session")
def llm(toy_path):
    """The offline engine on the toy checkpoint with the server's device and dtype: the reference."""
    from server_common import ENGINE_ARGS

    from ouro_backend import LLM

    return LLM(model=toy_path, **ENGINE_ARGS)
