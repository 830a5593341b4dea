#!/usr/bin/env bash
# Installs ouro-triton into the Python that serves it. The Dockerfile runs this inside NVIDIA's tritonserver
# image; CI runs it in a clean virtual environment (tests/test_container_install.py), which is how we know
# the steps work: the base image cannot be pulled where CI runs.
#
#   bash docker/install.sh [SOURCE_DIR]        (default: the checkout this script is in)
#
# Environment: OURO_TORCH_SPEC (default "torch": the CUDA build from PyPI), OURO_TOY_DIR (where the toy
# checkpoint is written; default /opt/ouro/toy), PYTHON (default python3).
set -euo pipefail
src=${1:-$(cd "$(dirname "$0")/.." && pwd)}
py=${PYTHON:-python3}
toy=${OURO_TOY_DIR:-/opt/ouro/toy}
echo "install.sh: installing $src into $($py -c 'import sys; print(sys.prefix)')"
# numpy<2: the 24.10 Python backend misreads numpy 2 output arrays ("output tensor shape does not match").
$py -m pip install --no-cache-dir -q "numpy<2" "${OURO_TORCH_SPEC:-torch}" "triton>=3.0" "tritonclient[all]>=2.50"
$py -m pip install --no-cache-dir -q "$src"
$py -m ouro_backend.model.toy --out "$toy" >/dev/null
$py - "$toy" <<'PY'
import sys

import numpy

import ouro_backend
from ouro_backend import LLM, SamplingParams

assert int(numpy.__version__.split(".")[0]) < 2, f"numpy {numpy.__version__}: the 24.10 stub needs numpy < 2"
out = LLM(model=sys.argv[1], device="cpu").generate("Hello", SamplingParams(max_tokens=2, temperature=0.0))[0]
print(f"install.sh: ok (ouro_backend from {ouro_backend.__file__}, numpy {numpy.__version__}, "
      f"{len(out.token_ids)} tokens generated)")
PY
