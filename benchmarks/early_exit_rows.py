"""ouro-bench results -> one row per measurement for the early-exit report, with each run's ratio to
full depth in the same file (same engine, same run), and a table on stdout.

    python benchmarks/early_exit_rows.py before.json after.json --out rows.json

A row: engine (the file's label), exit_mode, threshold (1.0 = full depth), concurrency, mean_depth,
output_tok_s (median of the repeats), ratio_vs_full, plus the repeats' tok/s, rounds per token, host
syncs per token and GPU idle fraction where the engine reports them, and the spread of the requests' own
mean depths, the decode occupancy and the tail's share of the wall time (see ouro-bench), and the
workload asked for (`target`: e.g. depth=1.6, whose threshold the bench found).

What bounds the ratio (closed loop): `rounds_ratio` is full depth's rounds over this run's; `round_ceiling` is
the same for the ideal closed loop on each run's own requests (ouro-bench's `ideal_rounds`): the most any
engine that advances a request by one loop per round can gain here if every round costs the same, as
weight-bound decode rounds nearly do. `loop_ceiling` (full depth's loops over this run's, about 4 / depth) is
what it could gain if a round cost only in proportion to its rows.
"""

from __future__ import annotations

import argparse
import json
import os

from table import dump, print_rows


def rows_of(results: dict) -> list[dict]:
    mode = results.get("engine_options", {}).get("exit_mode", "ouro")
    fulls = {r["concurrency"]: r["median"] for r in results["runs"] if r["workload"] == "full"}
    full = {c: m["output_tok_s"] for c, m in fulls.items()}

    def vs_full(c: int, key: str, m: dict):
        """Full depth's `key` over this run's, at the same concurrency (None where either lacks it)."""
        f = fulls.get(c, {}).get(key)
        return f / m[key] if f and m.get(key) else None

    rows = []
    for run in results["runs"]:
        m, c = run["median"], run["concurrency"]
        kind, _, arg = run["workload"].partition("=")
        # The repeats' median threshold (depth=D runs find one per repeat); older files name it in the workload.
        threshold = m.get("threshold") or (1.0 if kind == "full" else float(arg))
        rows.append(
            dict(
                engine=results.get("label", ""),
                exit_mode=mode,
                threshold=threshold,
                concurrency=c,
                mean_depth=m["mean_exit_depth"],
                output_tok_s=m["output_tok_s"],
                ratio_vs_full=m["output_tok_s"] / full[c] if c in full else None,
                repeats_tok_s=[r["output_tok_s"] for r in run["repeats"]],
                steady_decode_tok_s=m.get("steady_decode_tok_s"),
                ttft_p50_s=m["ttft_s"].get("p50"),
                rounds_per_token=m.get("rounds_per_token"),
                host_syncs_per_token=m.get("host_syncs_per_token"),
                gpu_idle_frac=m.get("gpu_idle_frac"),
                request_depth=m.get("request_depth"),
                target=run.get("target", run["workload"]),
                decode_occupancy=m.get("decode_occupancy"),
                tail_frac=m.get("tail_frac"),
                rounds=m.get("rounds"),
                ideal_rounds=m.get("ideal_rounds"),
                rounds_ratio=vs_full(c, "rounds", m),
                round_ceiling=vs_full(c, "ideal_rounds", m),
                loop_ceiling=vs_full(c, "request_loops", m),
            )
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+")
    p.add_argument("--out")
    args = p.parse_args()
    rows = []
    for path in args.files:
        if os.path.exists(path):
            with open(path) as f:
                rows += rows_of(json.load(f))
    print_rows(
        rows,
        [
            ("engine", "engine", 8, ""),
            ("threshold", "threshold", 10, ".2f"),
            ("conc", "concurrency", 6, "d"),
            ("depth", "mean_depth", 7, ".2f"),
            ("tok/s", "output_tok_s", 8, ".0f"),
            ("x full", "ratio_vs_full", 8, ".2f"),
            ("rnd/tok", "rounds_per_token", 9, ".2f"),
            ("sync/tok", "host_syncs_per_token", 10, ".3f"),
            ("GPU idle", "gpu_idle_frac", 10, ".1%"),
            ("occup", "decode_occupancy", 7, ".2f"),
            ("tail", "tail_frac", 7, ".0%"),
            ("rounds", "rounds", 8, ".0f"),
            ("ideal", "ideal_rounds", 7, ".0f"),
            ("x rounds", "rounds_ratio", 9, ".2f"),
            ("ceiling", "round_ceiling", 9, ".2f"),
        ],
    )
    dump(rows, args.out)


if __name__ == "__main__":
    main()
