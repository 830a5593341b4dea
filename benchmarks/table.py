"""Shared by the row scripts: a fixed-width table of result rows on stdout, and the rows as JSON."""

from __future__ import annotations

import json


def print_rows(rows: list[dict], columns: list[tuple[str, str, int, str]]) -> None:
    """columns: (header, row key, width, format spec); the first column is left-aligned, None prints '-'."""

    def cell(v, w, f, left):
        return ("-" if v is None else format(v, f)).ljust(w) if left else ("-" if v is None else format(v, f)).rjust(w)

    print("".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, _, w, _) in enumerate(columns)))
    for r in rows:
        print("".join(cell(r.get(k), w, f, i == 0) for i, (_, k, w, f) in enumerate(columns)))


def dump(rows: list[dict], path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)
