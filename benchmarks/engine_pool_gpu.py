"""Two engine processes on one GPU through EnginePool (ouro_backend/serving/engine_pool.py), without Triton: they
start one after the other and split the GPU's memory, EngineRouter spreads 128 requests (128 in / 64 out) over
them, one is killed and the other serves alone until it is back, then both again. Run on the device with
OURO_CACHE_DIR=/tmp/ourocache after `ouro-bench --shape ouro-1.4b` built the checkpoint."""

import os
import signal
import threading
import time

from ouro_backend import SamplingParams
from ouro_backend.config import EngineConfig
from ouro_backend.serving.engine_messages import Outputs
from ouro_backend.serving.engine_pool import EnginePool, EngineRouter

done, first, sent = {}, {}, {}
lock = threading.Lock()
closed = []


def on_message(i, msg):
    if not isinstance(msg, Outputs):
        return
    now = time.perf_counter()
    with lock:
        for d in msg.deltas:
            first.setdefault(d.rid, (now, i))
            if d.finish_reason:
                done[d.rid] = now


logs = []
cfg = EngineConfig(model="/tmp/ourocache/ouro-1.4b", max_num_seqs=64)
t = time.monotonic()
pool = EnginePool(
    "gpu-pool",
    os.getpid(),
    cfg,
    ["cuda:0", "cuda:0"],
    0.25,
    on_message,
    closed.append,
    lambda l, x: logs.append(x) or print(l, x, flush=True),
)
pool.start()
print(
    f"pool of 2 engines on cuda:0 started in {time.monotonic() - t:.1f}s: kv_blocks",
    [c.info.kv_blocks for c in pool.clients],
    flush=True,
)
router = EngineRouter(2)
for i, c in enumerate(pool.clients):
    router.set_client(i, c)
p = SamplingParams(max_tokens=64, ignore_eos=True, temperature=0.0)


def run(n, tag):
    t0 = time.perf_counter()
    for k in range(n):
        i, c = router.pick()
        rid = f"{tag}{k}"
        sent[rid] = time.perf_counter()
        c.add(rid, list(range(10 + k % 50, 138 + k % 50)), p)
    while sum(1 for r in sent if r.startswith(tag) and r in done) < n:
        time.sleep(0.01)
    wall = time.perf_counter() - t0
    per = [sum(1 for r in sent if r.startswith(tag) and first[r][1] == e) for e in (0, 1)]
    for r in [r for r in sent if r.startswith(tag)]:
        router.release(first[r][1])
    print(f"{tag}: {n} requests x 64 tokens in {wall:.2f}s = {n * 64 / wall:.0f} tok/s; per engine {per}", flush=True)


run(8, "warm")
run(128, "a")
pid = pool.processes[1].pid
os.kill(pid, signal.SIGKILL)
time.sleep(0.5)
run(32, "b")  # engine 0 alone while engine 1 restarts
t = time.monotonic()
while pool.clients[1].closed or pool.processes[1].pid == pid:
    time.sleep(0.2)
print(f"engine 1 back after {time.monotonic() - t:.1f}s more; closed={closed}", flush=True)
router.set_client(1, pool.clients[1])
run(128, "c")
pool.close()
print("closed", flush=True)
