#!/usr/bin/env bash
# Installs ouro-triton into the Python that serves it. The Dockerfile runs this inside NVIDIA's tritonserver
# image; CI runs it in a clean virtual environment (tests/test_container_install.py), which is how we know
# the steps work: the base image cannot be pulled where CI runs.
#
#   bash docker/install.sh [SOURCE_DIR]        (default: the checkout this script is in)
#
# Environment: OURO_TORCH_SPEC (default "torch": the CUDA build from PyPI), PYTHON (default python3).
# Checks what the image serves without --model: the demo model inside the installed package.
set -euo pipefail
src=${1:-$(cd "$(dirname "$0")/.." && pwd)}
py=${PYTHON:-python3}
echo "install.sh: installing $src into $($py -c 'import sys; print(sys.prefix)')"
# numpy<2: the 24.10 Python backend misreads numpy 2 output arrays ("output tensor shape does not match").
$py -m pip install -q "numpy<2" "${OURO_TORCH_SPEC:-torch}" "triton>=3.0" "tritonclient[all]>=2.50" \
  "fastapi>=0.110" "uvicorn>=0.29" "jinja2>=3.1"  # the last three: ouro-serve --openai-port
$py -m pip install -q "$src"
# From / so that the installed package is imported, not a source tree in the working directory.
(cd / && $py - "$src") <<'PY'
import sys
from pathlib import Path

import numpy

import ouro_backend
import ouro_backend.entrypoints.openai_api  # noqa: F401  (ouro-serve --openai-port: FastAPI, uvicorn, jinja2)
from ouro_backend import LLM, SamplingParams
from ouro_backend.models import default_model

assert int(numpy.__version__.split(".")[0]) < 2, f"numpy {numpy.__version__}: the 24.10 stub needs numpy < 2"
model = default_model()  # what ouro-serve serves with no --model and no $OURO_MODEL_PATH
assert not Path(model).resolve().is_relative_to(Path(sys.argv[1]).resolve()), f"{model}: the source tree's, not installed"
llm = LLM(device="cpu", dtype="float32")  # model=None: the demo model
out = llm.generate("Once upon a time", SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
assert len(out.token_ids) == 8 and out.text.strip(), out
print(f"install.sh: ok (ouro_backend from {ouro_backend.__file__}, numpy {numpy.__version__}, "
      f"demo model {model}: {out.text!r})")
PY
