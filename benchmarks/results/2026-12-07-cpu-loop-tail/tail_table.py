"""Issue 29's closed runs, read again: how much of each gated run is its tail, and what its rows did.

    python3 tail_table.py ../2026-12-03-h200-loop-efficiency/c64_128_512.json [...]

For each run of an `ouro-bench` JSON: output tok/s, the decode throughput of its steady state
(`steady_decode_tok_s`: decode rounds while every slot is busy), `tail_frac` (the share of the wall time after
the last submission, with fewer than C requests running), `decode_occupancy` (busy decode rows over slots,
over the run), the per-request mean exit depth (p50 / p90 / p99), and for gated runs the ratio of the steady
states against full depth's, beside 4 / mean depth (the yardstick without prompt work)."""

import json
import sys

for path in sys.argv[1:]:
    doc = json.load(open(path))
    full = {}
    for run in doc["runs"]:
        rep = run["repeats"][0]
        c = run["concurrency"]
        d = rep["request_depth"]
        row = (
            f"{path.rsplit('/', 1)[-1]} C{c} {run['workload']:>9}: {rep['output_tok_s']:7.0f} tok/s, steady decode "
            f"{rep['steady_decode_tok_s']:7.0f}, tail {rep['tail_frac']:.3f}, occupancy {rep['decode_occupancy']:.3f}, "
            f"request depth p50 {d['p50']:.2f} p90 {d['p90']:.2f} p99 {d['p99']:.2f} "
            f"(mean {rep['mean_exit_depth']:.2f})"
        )
        if run["workload"] == "full":
            full[c] = rep
        elif c in full:
            steady = rep["steady_decode_tok_s"] / full[c]["steady_decode_tok_s"]
            row += f"; steady / full {steady:.2f} against 4 / depth {4 / rep['mean_exit_depth']:.2f}"
        print(row)
