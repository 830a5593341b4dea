"""Issue 25, full depth C64: where the 12 ms "client sent -> front received" hop comes from. Reads this run's
request_trace (client and front marks, joined through the request id), groups the client's sends into bursts
(a gap of more than 3 ms starts a new one) and prints the inbound wait by position in the burst, each front
instance's intake rate during the largest bursts, and how many requests each instance took.

    python3 inbound_bursts.py [request_trace]
"""

import collections
import glob
import json
import statistics
import sys

trace = sys.argv[1] if len(sys.argv) > 1 else "request_trace"
client, front, alias, instance = {}, {}, {}, {}
for path in glob.glob(f"{trace}/*.json"):
    d = json.load(open(path))
    for rid, marks in d["marks"].items():
        if d["role"] == "client":
            client[rid] = marks
        elif d["role"] == "front":
            front.setdefault(rid, {}).update(marks)
            instance[rid] = path
    alias.update(d.get("aliases", {}))
rows = []
for rid, marks in client.items():
    f = front.get(rid) or front.get(alias.get(rid, ""))
    if f and "received" in f:
        rows.append((marks["sent"], f["received"], instance.get(rid) or instance.get(alias.get(rid, ""))))
rows.sort()
bursts = [[rows[0]]]
for r in rows[1:]:
    (bursts.append([r]) if r[0] - bursts[-1][-1][0] > 0.003 else bursts[-1].append(r))
sizes = [len(b) for b in bursts]
big = [b for b in bursts if len(b) >= 16]
print(f"{len(rows)} requests in {len(bursts)} bursts; {sum(map(len, big)) / len(rows):.0%} of them in bursts of >= 16 "
      f"(largest {max(sizes)})")
by_pos = collections.defaultdict(list)
for b in bursts:
    for i, r in enumerate(b):
        by_pos[min(i // 8, 7)].append((r[1] - r[0]) * 1e3)
for k in sorted(by_pos):
    print(f"  position {8 * k:2d}-{8 * k + 7:2d} in its burst: {len(by_pos[k]):3d} requests, "
          f"sent -> front received median {statistics.median(by_pos[k]):5.2f} ms")
spread = [(b[-1][0] - b[0][0]) * 1e3 for b in big]
per_instance = []
for b in big:
    for inst in {r[2] for r in b}:
        got = sorted(r[1] for r in b if r[2] == inst)
        if len(got) > 4:
            per_instance.append((got[-1] - got[0]) * 1e3 / (len(got) - 1))
print(f"bursts of >= 16: the client's sends spread over {statistics.median(spread):.1f} ms (median); each front "
      f"instance took one request every {statistics.median(per_instance):.2f} ms (median)")
taken = collections.Counter(r[2].rsplit("/", 1)[-1] for r in rows)
print("requests per front instance: " + ", ".join(f"{name} {n}" for name, n in sorted(taken.items())))
