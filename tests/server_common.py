"""What the real-server test modules (tests/test_server_*.py) share: the device and engine options, the
prompts, the server factory and a few helpers. The server itself is the session fixture `server` of
conftest.py: one real tritonserver for all of them."""

from __future__ import annotations

import os
import re
import urllib.request

import pytest

from client.ouro_client import request_options
from ouro_backend import SamplingParams
from ouro_backend.entrypoints.tritonserver import ServerError, TritonServer, free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The server's engine and the offline reference run the same device and dtype (fp32: greedy results are
# compared token for token). OURO_TEST_DEVICE=cuda runs both on the GPU.
DEVICE = os.environ.get("OURO_TEST_DEVICE", "cpu")
ENGINE_ARGS = {"device": DEVICE, "dtype": "float32"}
if DEVICE != "cpu":
    # A fixed KV size: automatic sizing would give the test process's offline engine 90% of the GPU and
    # leave the server's engine none.
    ENGINE_ARGS["num_blocks"] = 4096
# A test server's start timeout: under the 300 s test timeout of the server modules, so that a start that
# hangs ends in TritonServer's ServerError (each model's state and the log's tail), not a bare Timeout.
START_TIMEOUT_S = 240
# Tokens the engine may still make between a client's cancel and the abort (one watcher interval and a
# round): the toy makes a few hundred tokens/s on 2 CPU cores, thousands on a GPU.
MAX_AFTER_CANCEL = 200 if DEVICE == "cpu" else 1000
PROMPT = "Once upon a time there was a little robot who"
PROMPTS = [
    "Once upon a time there was a little robot who",
    "The quick brown fox jumps over the lazy dog.",
    " leading space and  two spaces",
    "héllo wörld: naïve café 🙂 你好，世界",
    "def add(a, b):\n    return",
    "Questions and answers: What is the capital of France?",
    "The weather today is sunny with a few clouds",
    "Le café est très bon ce matin. Où est",
]


def server_or_skip(**kwargs) -> TritonServer:
    """A TritonServer on free ports (not started), or a skip when no tritonserver can be found."""
    try:
        from ouro_backend.entrypoints.tritonserver import find_tritonserver

        find_tritonserver()
    except ServerError as e:
        pytest.skip(f"no tritonserver available: {e}")
    return TritonServer(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(), **kwargs)


def offline(llm, prompt, **params):
    return llm.generate([prompt], SamplingParams(**params))[0]


def metrics(server) -> dict[str, float]:
    """The engine's own metrics (label model="ouro_engine"), summed over other labels."""
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    out: dict[str, float] = {}
    for name, labels, value in re.findall(r"^(ouro_[a-z0-9_]+)\{([^}]*)\} (\S+)$", text, re.M):
        if 'model="ouro_engine"' in labels:
            key = name
            le = re.search(r'le="([^"]+)"', labels)
            if name.endswith("_bucket") and le:
                key = name + "{" + le.group(1) + "}"
            out[key] = out.get(key, 0.0) + float(value)
    return out


def all_flags(**kw):
    return request_options(return_num_input_tokens=True, return_num_output_tokens=True, return_finish_reason=True, **kw)
