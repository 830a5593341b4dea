#!/usr/bin/env python3
"""perf_analyzer's measurement windows and the requests it kept open, from its profile exports.

    python pa_windows.py served/*/ouro_c64.requests.json          # the compact copies kept here
    python pa_windows.py --compact RUN/perf_analyzer/ouro_c64.profile_export.json --out served/NAME/

A full export (8.7 MB at C64: every response's timestamp) is reduced with --compact to each request's send
time, first and last response and response count (`*.requests.json`); the analysis reads either form. For
each export it prints the windows (requests that ended inside each, and their rate), the time-averaged
requests in flight over the windows, and the requests in flight every 0.25 s from the first send.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os


def load(path: str) -> tuple[list[dict], list[int]]:
    with open(path) as f:
        d = json.load(f)
    if "experiments" in d:  # a full profile export
        ex = d["experiments"][0]
        reqs = [
            {"send": r["timestamp"], "first": r["response_timestamps"][0], "last": r["response_timestamps"][-1],
             "responses": len(r["response_timestamps"])}
            for r in ex["requests"] if r.get("response_timestamps")
        ]  # fmt: skip
        return reqs, ex["window_boundaries"]
    return d["requests"], d["window_boundaries"]


def analyze(reqs: list[dict], bounds: list[int]) -> dict:
    t0 = min(r["send"] for r in reqs)
    sends, ends = sorted(r["send"] for r in reqs), sorted(r["last"] for r in reqs)
    windows = []
    for a, b in zip(bounds, bounds[1:]):
        n = sum(1 for e in ends if a <= e < b)
        windows.append({"from_s": round((a - t0) / 1e9, 3), "to_s": round((b - t0) / 1e9, 3), "requests": n,
                        "req_per_s": round(n / ((b - a) / 1e9), 2)})  # fmt: skip
    lo, hi = bounds[0], bounds[-1]
    open_ns = sum(max(0, min(r["last"], hi) - max(r["send"], lo)) for r in reqs)
    steps = int((ends[-1] - t0) / 0.25e9) + 2
    in_flight = [bisect.bisect_right(sends, t0 + k * 0.25e9) - bisect.bisect_right(ends, t0 + k * 0.25e9)
                 for k in range(steps)]  # fmt: skip
    return {"requests": len(reqs), "windows": windows, "mean_in_flight_over_windows": round(open_ns / (hi - lo), 1),
            "in_flight_every_250ms": in_flight}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("exports", nargs="+")
    ap.add_argument("--compact", action="store_true", help="write each export's *.requests.json to --out")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    for path in args.exports:
        reqs, bounds = load(path)
        if args.compact:
            os.makedirs(args.out, exist_ok=True)
            name = os.path.basename(path).replace(".profile_export.json", ".requests.json")
            with open(os.path.join(args.out, name), "w") as f:
                json.dump({"window_boundaries": bounds, "requests": reqs}, f)
        res = analyze(reqs, bounds)
        print(path)
        for w in res["windows"]:
            print(f"  window {w['from_s']:6.2f}-{w['to_s']:6.2f} s: {w['requests']:4d} requests, {w['req_per_s']:7.2f}/s")
        print(f"  mean in flight over the windows: {res['mean_in_flight_over_windows']}")
        print(f"  in flight every 0.25 s: {res['in_flight_every_250ms']}")


if __name__ == "__main__":
    main()
