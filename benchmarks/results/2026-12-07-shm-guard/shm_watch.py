"""How long each Python backend shared-memory region stays readable by others: starts the demo model's server
(CPU, `--private-shm off`, so the chmod guard is what protects the regions), polls /dev/shm every 1 ms from
the start until 3 s after ready, and prints each region's (name tail, inode) and its mode changes with their
times (seconds from the start).   .venv/bin/python benchmarks/results/2026-12-07-shm-guard/shm_watch.py"""

import os
import threading
import time

from ouro_backend.entrypoints.tritonserver import TritonServer, free_port

s = TritonServer(
    model="ouro_backend/models/ouro-demo",
    engine_args={"device": "cpu", "dtype": "float32"},
    address="127.0.0.1",
    http_port=free_port(),
    grpc_port=free_port(),
    metrics_port=free_port(),
    private_shm="off",
)
seen: dict = {}
stop = False
t0 = time.monotonic()


def watch():
    while not stop:
        for e in os.scandir("/dev/shm"):
            if s.shm_prefix and e.name.startswith(s.shm_prefix):
                try:
                    m = oct(e.stat().st_mode & 0o777)
                except OSError:
                    continue
                k = (e.name, e.inode())
                if k not in seen or seen[k][-1][1] != m:
                    seen.setdefault(k, []).append((round(time.monotonic() - t0, 3), m))
        time.sleep(0.001)


threading.Thread(target=watch, daemon=True).start()
s.start(wait=True)
print("ready at", round(time.monotonic() - t0, 3))
s.mark_ready()
time.sleep(3)
stop = True
for k, v in sorted(seen.items(), key=lambda kv: kv[1][0][0]):
    print(k[0][-40:], k[1], v)
s.stop()
