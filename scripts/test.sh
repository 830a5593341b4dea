#!/usr/bin/env bash
# The test command (README): the whole suite on CPU: engine vs the dense oracle, kernels under the Triton
# interpreter, and a real tritonserver (the nvidia-pytriton wheel's) for the serving tests.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
[ -x "$PY" ] || PY=python3
"$PY" -m pytest -q -ra --durations=15 "$@"
rc=$?
[ $rc -eq 5 ] && { echo "no tests collected"; exit 1; }
exit $rc
