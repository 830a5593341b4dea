"""ouro-bench results of deferred deep batching -> one row per (interval, concurrency), with its ratios to the
eager same-readout control of the same interval and to full depth, and a table on stdout.

    python benchmarks/deferred_deep_rows.py full.json deferred_b4.json eager_b4.json ... --out rows.json

Each input is one ouro-bench run: full depth (no deferred option), or an engine with
`deferred_deep_interval=B` (and `deferred_deep_eager=true` for the control). A row: interval, concurrency,
output_tok_s (median of the repeats), ratio_vs_eager_same_readout, ratio_vs_full_depth, deep_rows_per_call
(deep chunk tokens per round that ran any: N aligned requests give N x B), mean_depth, and the eager
control's own tok/s. At B = 1 the control is the full-depth run when no eager B = 1 run is given (the same
policy: every token is a boundary); `eager_control` says which.
"""

from __future__ import annotations

import argparse
import json

from table import dump, print_rows


def rows_of(files: list[dict]) -> list[dict]:
    full: dict[int, dict] = {}  # concurrency -> the full-depth run's median
    runs: dict[tuple[int, bool, int], dict] = {}  # (interval, eager, concurrency) -> median
    for results in files:
        for run in results["runs"]:
            m, c = run["median"], run["concurrency"]
            B = m.get("deferred_deep_interval") or 0
            if not B:
                if run["workload"] == "full":
                    full[c] = m
                continue
            runs[(B, bool(m.get("deferred_deep_eager")), c)] = m
    rows = []
    for (B, eager, c), m in sorted(runs.items()):
        if eager:
            continue
        control, kind = runs.get((B, True, c)), "eager"
        # NOTE: at B = 1 every token is a boundary, so the eager same-readout policy is full depth itself.
        if control is None and B == 1 and c in full:
            control, kind = full[c], "full depth"
        tok_s = m["output_tok_s"]
        rows.append(
            dict(
                interval=B,
                concurrency=c,
                output_tok_s=tok_s,
                ratio_vs_eager_same_readout=tok_s / control["output_tok_s"] if control else None,
                ratio_vs_full_depth=tok_s / full[c]["output_tok_s"] if c in full else None,
                deep_rows_per_call=m.get("deep_rows_per_call"),
                mean_depth=m.get("mean_exit_depth"),
                eager_control=kind if control else None,
                eager_output_tok_s=control["output_tok_s"] if control else None,
                eager_mean_depth=control.get("mean_exit_depth") if control else None,
                full_depth_output_tok_s=full[c]["output_tok_s"] if c in full else None,
            )
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+")
    p.add_argument("--out")
    args = p.parse_args()
    files = []
    for path in args.results:
        with open(path) as f:
            files.append(json.load(f))
    rows = rows_of(files)
    print_rows(
        rows,
        [
            ("B", "interval", 4, "d"),
            ("conc", "concurrency", 6, "d"),
            ("tok/s", "output_tok_s", 9, ".0f"),
            ("vs eager", "ratio_vs_eager_same_readout", 10, ".2f"),
            ("vs full", "ratio_vs_full_depth", 9, ".2f"),
            ("deep rows", "deep_rows_per_call", 11, ".1f"),
            ("depth", "mean_depth", 7, ".2f"),
            ("eager tok/s", "eager_output_tok_s", 13, ".0f"),
            ("full tok/s", "full_depth_output_tok_s", 12, ".0f"),
        ],
    )
    dump(rows, args.out)


if __name__ == "__main__":
    main()
