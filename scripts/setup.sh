#!/usr/bin/env bash
# One-time setup on a fresh machine: a venv in .venv with the engine, the test tools and the Triton server
# wheel (nvidia-pytriton ships tritonserver 2.51 = container 24.10); perf_analyzer needs libb64 from Debian.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null
# torch==2.13.0 is the CPU build on local disk here; a plain 'torch' would pull a multi-GB CUDA build.
python -m pip install -q "torch==2.13.0" 2>/dev/null || python -m pip install -q torch
python -m pip install -q -e ".[test]"
# From Debian: libb64 for perf_analyzer; wamerican, the word list tests/test_demo_model.py checks English with.
debs=()
ldconfig -p 2>/dev/null | grep -q libb64.so.0d || debs+=(libb64-0d)
[ -f /usr/share/dict/american-english ] || debs+=(wamerican)
if [ ${#debs[@]} -gt 0 ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  (apt-get install -y -q "${debs[@]}" >/dev/null 2>&1 || (apt-get update -q >/dev/null && apt-get install -y -q "${debs[@]}" >/dev/null)) \
    || echo "setup: could not install ${debs[*]} (perf_analyzer tests are skipped without libb64-0d)"
fi
# AIPerf (client/aiperf) in a venv of its own: it needs Python >= 3.11 and pins older pandas/huggingface_hub.
python client/aiperf/run_aiperf.py --install >/dev/null || echo "setup: AIPerf not installed (tests/test_aiperf.py tries again, and skips if it cannot)"
echo "setup: done ($(python -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__)'))"
