"""perf_analyzer 2.50 with a warm-up of fewer requests than the concurrency (CPU, stand-in engine at 20 ms a
launch, demo model): which combinations finish and which hang (60 s limit each). Run from the repository root:

    python benchmarks/results/2026-12-05-h200-session/pa_warmup_hang.py   # -> pa_warmup_hang.txt
"""

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
CASES = [(4, 2, []), (4, 4, []), (4, 16, []), (4, 2, ["--max-threads", "4"]), (8, 4, [])]  # (C, warm-up, extra)


def main() -> None:
    sys.path[:0] = [str(ROOT), str(ROOT / "client" / "perf_analyzer")]
    from locate import locate
    from make_input_data import make_input_data

    from benchmarks.stand_in_engine import ROUND_MS_ENV
    from ouro_backend.entrypoints.tritonserver import TritonServer, free_port
    from ouro_backend.serving.engine_server import RUNNER_ENV

    binary, env = locate()
    srv = TritonServer(
        model=str(ROOT / "ouro_backend" / "models" / "ouro-demo"),
        http_port=free_port(),
        grpc_port=free_port(),
        metrics_port=free_port(),
        engine_args={"device": "cpu", "max_num_seqs": "16"},
        env={RUNNER_ENV: "benchmarks.stand_in_engine:StandInRunner", ROUND_MS_ENV: "20", "PYTHONPATH": str(ROOT)},
    )
    inp = "/tmp/pa_warmup_hang_input.json"
    with open(inp, "w") as f:
        json.dump(make_input_data(64, 16), f)
    with srv:
        for c, w, extra in CASES:
            cmd = [binary, "-m", "ouro", "-i", "grpc", "--streaming", "-u", srv.grpc_url, "--input-data", inp]
            cmd += ["--concurrency-range", str(c), "--measurement-mode", "count_windows"]
            cmd += ["--measurement-request-count", str(2 * c), "--max-trials", "3", "--stability-percentage", "999"]
            cmd += ["--warmup-request-count", str(w), *extra]
            t = time.time()
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
                out = "ok" if r.returncode == 0 else f"rc {r.returncode}"
            except subprocess.TimeoutExpired:
                out = "HANG (60 s)"
            print(f"C{c} warmup {w} {extra}: {out} in {time.time() - t:.1f}s", flush=True)


if __name__ == "__main__":
    main()
