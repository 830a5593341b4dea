"""How a served run's requests came in: the client's sends grouped into bursts (a gap of more than 3 ms starts
a new one), the wait from the client's send to the front's `execute()` by position in the burst, each front
instance's intake during bursts of 16 or more, and how many requests each instance took. Reads the request
trace of `benchmarks/served.py --trace` (`ouro_backend/serving/request_trace.py`; it needs client marks).

    python3 benchmarks/request_bursts.py OUT/request_trace

Why: at full depth every request of a wave ends in the same round and a closed-loop client replaces them all
at once; the front then takes them one `execute()` at a time per instance
(benchmarks/results/2026-12-05-session-5/README.md).
"""

from __future__ import annotations

import collections
import statistics
import sys

from ouro_backend.serving import request_trace

GAP_S = 0.003


def report(directory: str) -> list[str]:
    files = request_trace.load(directory)
    marks = request_trace.join(files)
    aliases = request_trace.canonical_ids(files)
    instance = {aliases.get(rid, rid): path for path, d in files.items() if d["role"] == "front" for rid in d["marks"]}
    rows = sorted(
        (m["client.sent"], m["front.received"], instance[rid])
        for rid, m in marks.items()
        if "client.sent" in m and "front.received" in m
    )
    if not rows:
        return [f"{directory}: no request with both a client send and a front receipt"]
    bursts = [[rows[0]]]
    for r in rows[1:]:
        if r[0] - bursts[-1][-1][0] > GAP_S:
            bursts.append([r])
        else:
            bursts[-1].append(r)
    big = [b for b in bursts if len(b) >= 16]
    out = [
        f"{len(rows)} requests in {len(bursts)} bursts; {sum(map(len, big)) / len(rows):.0%} of them in bursts of "
        f">= 16 (largest {max(map(len, bursts))})"
    ]
    by_pos = collections.defaultdict(list)
    for b in bursts:
        for i, (sent, received, _) in enumerate(b):
            by_pos[min(i // 8, 7)].append((received - sent) * 1e3)
    for k in sorted(by_pos):
        out.append(
            f"  position {8 * k:2d}-{8 * k + 7:2d} in its burst: {len(by_pos[k]):3d} requests, "
            f"sent -> front received median {statistics.median(by_pos[k]):5.2f} ms"
        )
    if big:
        spread = [(b[-1][0] - b[0][0]) * 1e3 for b in big]
        intake = []
        for b in big:
            for inst in {r[2] for r in b}:
                got = sorted(r[1] for r in b if r[2] == inst)
                if len(got) > 4:
                    intake.append((got[-1] - got[0]) * 1e3 / (len(got) - 1))
        if intake:
            out.append(
                f"bursts of >= 16: the client's sends spread over {statistics.median(spread):.1f} ms (median); each "
                f"front instance took one request every {statistics.median(intake):.2f} ms (median)"
            )
    taken = collections.Counter(path.rsplit("/", 1)[-1] for *_, path in rows)
    out.append("requests per front instance: " + ", ".join(f"{name} {n}" for name, n in sorted(taken.items())))
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    print("\n".join(report(argv[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
