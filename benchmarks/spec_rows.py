"""ouro-bench results of plain and speculative engines -> one row per measurement, with the speedup of
speculation against plain decoding of the same model in the same run.

    python benchmarks/spec_rows.py plain.json spec.json [plain2.json spec2.json ...] --out rows.json

Files come in pairs (plain first); a row: model, concurrency, input/output lengths, spec_tokens,
spec_draft_loops, acceptance (accepted / drafted), mean accepted length, output_tok_s (median), the plain
engine's, spec_speedup, speculative steps and launches (eager ones apart), and the workload's arrivals and
stopping rule.
"""

from __future__ import annotations

import argparse
import json

from table import dump, print_rows


def rows_of(plain: dict, spec: dict) -> list[dict]:
    opts = spec.get("engine_options", {})
    base = {(r["workload"], r["concurrency"]): r["median"] for r in plain["runs"]}
    rows = []
    for run in spec["runs"]:
        m, c = run["median"], run["concurrency"]
        p = base.get((run["workload"], c))
        rows.append(
            dict(
                model=opts.get("model"),
                label=spec.get("label"),
                concurrency=c,
                input_len=spec["input_len"],
                output_len=spec["output_len"],
                spec_tokens=int(opts.get("spec_tokens", 0)),
                spec_draft_loops=int(opts.get("spec_draft_loops", 1)),
                spec_auto=opts.get("spec_auto", "true"),
                acceptance=m.get("spec_acceptance"),
                mean_accepted_length=m.get("spec_mean_accepted_length"),
                spec_steps=m.get("spec_steps"),
                launches=m.get("launches"),
                eager_launches=m.get("eager_launches"),
                plain_eager_launches=p.get("eager_launches") if p else None,
                arrival_rate=spec.get("arrival_rate"),
                natural_eos=spec.get("natural_eos"),
                eos_every=spec.get("eos_every"),
                generated_tokens=m.get("generated_tokens"),
                output_tok_s=m["output_tok_s"],
                repeats_tok_s=[r["output_tok_s"] for r in run["repeats"]],
                plain_tok_s=p["output_tok_s"] if p else None,
                spec_speedup=m["output_tok_s"] / p["output_tok_s"] if p else None,
                ttft_p50_s=m["ttft_s"].get("p50"),
                plain_ttft_p50_s=p["ttft_s"].get("p50") if p else None,
            )
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--out")
    args = ap.parse_args()
    if len(args.files) % 2:
        ap.error("give the files in pairs: plain.json spec.json")
    rows = []
    for plain, spec in zip(args.files[::2], args.files[1::2]):
        with open(plain) as f, open(spec) as g:
            rows += rows_of(json.load(f), json.load(g))
    print_rows(
        rows,
        [
            ("label", "label", 26, ""),
            ("conc", "concurrency", 5, "d"),
            ("K", "spec_tokens", 3, "d"),
            ("d", "spec_draft_loops", 3, "d"),
            ("accept", "acceptance", 8, ".1%"),
            ("len", "mean_accepted_length", 6, ".2f"),
            ("tok/s", "output_tok_s", 9, ".0f"),
            ("plain", "plain_tok_s", 9, ".0f"),
            ("speedup", "spec_speedup", 9, ".2f"),
            ("eager", "eager_launches", 6, ".0f"),
        ],
    )
    dump(rows, args.out)


if __name__ == "__main__":
    main()
