"""perf_analyzer's measured windows with and without the first, and when its streams began sending, from the
exports reduced to each request's times (`*.requests.json`, `../2026-12-05-h200-session/pa_windows.py --compact`).

    python3 start_steps.py EXPORT.requests.json ...   # from this folder: see README.md for the list

For each export: every window's requests ended per second, the rate over all windows and over those after the
first (x tokens a request: output tok/s), and the times, from the first window's start, at which the requests open
first rose to each new count (a stream's first send), grouped by the second they fall in.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("exports", nargs="+")
    ap.add_argument("--tokens", type=int, default=64, help="tokens a request streams")
    args = ap.parse_args()
    for path in args.exports:
        d = json.load(open(path))
        reqs, bounds = sorted(d["requests"], key=lambda r: r["send"]), d["window_boundaries"]
        ends = sorted(r["last"] for r in reqs)
        windows = [(sum(1 for e in ends if a <= e < b), (b - a) / 1e9) for a, b in zip(bounds, bounds[1:])]
        rate_all = sum(n for n, _ in windows) / sum(s for _, s in windows)
        rate_later = sum(n for n, _ in windows[1:]) / sum(s for _, s in windows[1:])
        sends = [r["send"] for r in reqs]
        level, by_second = 0, collections.Counter()
        for r in reqs:  # a new high of requests open: a stream's first send
            open_now = bisect.bisect_right(sends, r["send"]) - bisect.bisect_right(ends, r["send"])
            if open_now > level:
                by_second[int((r["send"] - bounds[0]) / 1e9)] += open_now - level
                level = open_now
        print(path)
        print(f"  windows, req/s: {[round(n / s, 1) for n, s in windows]}")
        print(
            f"  all windows {rate_all:.1f} req/s ({rate_all * args.tokens:.0f} tok/s), after the first "
            f"{rate_later:.1f} req/s ({rate_later * args.tokens:.0f} tok/s)"
        )
        print(f"  streams starting, by second from the first window's start: {dict(sorted(by_second.items()))}")


if __name__ == "__main__":
    main()
