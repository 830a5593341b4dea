"""Open N gRPC channels to a server at once and time each one's connect (grpc.channel_ready_future).

python3 connburst.py HOST:GRPC_PORT N
"""

import sys
import threading
import time

import grpc


def main() -> None:
    url, n = sys.argv[1], int(sys.argv[2])
    times: list[float | None] = [None] * n  # None: did not connect within 20 s
    channels = []

    def connect(i: int) -> None:
        ch = grpc.insecure_channel(url, options=[("grpc.use_local_subchannel_pool", 1)])  # a connection each
        channels.append(ch)
        t = time.perf_counter()
        try:
            grpc.channel_ready_future(ch).result(timeout=20)
        except grpc.FutureTimeoutError:
            return
        times[i] = time.perf_counter() - t

    threads = [threading.Thread(target=connect, args=(i,)) for i in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    ts = sorted(t for t in times if t is not None)
    if not ts:
        raise SystemExit(f"{n} channels: none connected to {url} within 20 s")
    print(
        f"{n} channels: connect s min {ts[0]:.3f} p50 {ts[len(ts) // 2]:.3f} max {ts[-1]:.3f}; "
        f"over 0.5 s: {sum(t > 0.5 for t in ts)}; not connected: {n - len(ts)}"
    )


if __name__ == "__main__":
    main()
