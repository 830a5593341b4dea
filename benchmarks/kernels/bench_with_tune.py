"""ouro-bench with a `loop_bench.py tune` result in place of the decode table at the row counts it tuned:
the end-to-end check a loop tune's winners need before they go into `DECODE_TABLE`.

    PYTHONPATH=$PWD python3 benchmarks/kernels/bench_with_tune.py TUNE.json [ouro-bench arguments]

Row counts the tune did not cover keep the table. Run it beside plain ouro-bench in the same call.
"""

from __future__ import annotations

import json
import sys

from benchmarks.kernels.loop_bench import table_override, tuned_choices
from ouro_backend.entrypoints.bench import main as bench_main


def main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        chosen = tuned_choices(json.load(f)["table"])
    print("table override:", {k: None if c is None else c.name for k, c in chosen.items()}, flush=True)
    with table_override(chosen):
        return bench_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
