#!/usr/bin/env bash
# The test command (README): the whole suite on CPU, kernels under the Triton interpreter, a real tritonserver.
set -uo pipefail
cd "$(dirname "$0")/.."
python -m pytest -q -ra --durations=15 "$@"
rc=$?
[ $rc -eq 5 ] && { echo "no tests collected"; exit 1; }
exit $rc
