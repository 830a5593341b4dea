"""What one streamed response costs in a Triton Python stub alone, without our code: a decoupled model sends
N responses of the front's two tensors (text_output, exit_depths) on one gRPC stream as fast as `send()`
returns, and reports its wall and process CPU time per send; the client (tritonclient, gRPC streaming)
reports the end-to-end time per response. Also times building the tensors and the response in the stub, and
`is_cancelled()` (what the front's cancel watcher asks of every open request).

    python benchmarks/results/2026-12-04-cpu-front-direct/send_cost.py [--n 20000] [--out send_cost.json]
"""

from __future__ import annotations

import argparse
import json
import queue
import re
import tempfile
import time
from pathlib import Path

import numpy as np

CONFIG = """name: "sendbench"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] }, { name: "THREADS" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "text_output" data_type: TYPE_STRING dims: [ -1 ] },
         { name: "exit_depths" data_type: TYPE_INT32 dims: [ -1 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
"""

MODEL = """
import json, threading, time
import numpy as np
import triton_python_backend_utils as pb

TEXT = np.asarray([[b" hello"]], dtype=np.object_)
DEPTHS = np.asarray([[4]], dtype=np.int32)


def _response():
    return pb.InferenceResponse(output_tensors=[pb.Tensor("text_output", TEXT), pb.Tensor("exit_depths", DEPTHS)])


def _per_call_us(fn, n=20000):
    for _ in range(500):
        fn()
    runs = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - t) / n * 1e6)
    return round(sorted(runs)[2], 2)


class TritonPythonModel:
    def initialize(self, args):
        build = {
            "pb.Tensor(text_output, BYTES)": _per_call_us(lambda: pb.Tensor("text_output", TEXT)),
            "pb.Tensor(exit_depths, INT32)": _per_call_us(lambda: pb.Tensor("exit_depths", DEPTHS)),
            "InferenceResponse(both tensors)": _per_call_us(_response),
        }
        print("SENDCOST build " + json.dumps(build), flush=True)

    def execute(self, requests):
        for request in requests:
            n = int(pb.get_input_tensor_by_name(request, "N").as_numpy().reshape(-1)[0])
            k = int(pb.get_input_tensor_by_name(request, "THREADS").as_numpy().reshape(-1)[0])
            threading.Thread(target=self.run, args=(request.get_response_sender(), n, k), daemon=True).start()
        return None

    def run(self, sender, n, k):
        if k == 1:  # what the front's cancel watcher asks of every open request each interval
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(2000):
                sender.is_cancelled()
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            row = dict(wall_us=round(wall / 2000 * 1e6, 1), stub_cpu_us=round(cpu / 2000 * 1e6, 1))
            print("SENDCOST is_cancelled " + json.dumps(row), flush=True)
        lock = threading.Lock()
        t0, c0 = time.perf_counter(), time.process_time()

        def part(m):
            for _ in range(m):
                r = _response()
                with lock:  # one stream: in order, as the front's sender keeps a request's responses
                    sender.send(r)

        threads = [threading.Thread(target=part, args=(n // k,)) for _ in range(k)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        row = dict(n=n, threads=k, wall_us_per_send=round(wall / n * 1e6, 1))
        row["stub_cpu_us_per_send"] = round(cpu / n * 1e6, 1)
        print("SENDCOST send " + json.dumps(row), flush=True)
        sender.send(flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=20000, help="responses per run")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import tritonclient.grpc as grpcclient

    from ouro_backend.entrypoints.tritonserver import TritonServer, free_port

    tmp = Path(tempfile.mkdtemp(prefix="send-cost-"))
    (tmp / "repo" / "sendbench" / "1").mkdir(parents=True)
    (tmp / "repo" / "sendbench" / "config.pbtxt").write_text(CONFIG)
    (tmp / "repo" / "sendbench" / "1" / "model.py").write_text(MODEL)
    log = tmp / "tritonserver.log"
    server = TritonServer(
        model_repository=str(tmp / "repo"), http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
        log_file=str(log),
    )  # fmt: skip
    server.start(wait=True, timeout=300)
    client_rows = []
    try:
        for k in (1, 1, 8):  # the first run warms up
            q: queue.Queue = queue.Queue()
            c = grpcclient.InferenceServerClient(server.grpc_url)
            c.start_stream(callback=lambda result, error: q.put(error))
            inputs = [grpcclient.InferInput("N", [1], "INT32"), grpcclient.InferInput("THREADS", [1], "INT32")]
            inputs[0].set_data_from_numpy(np.array([args.n], np.int32))
            inputs[1].set_data_from_numpy(np.array([k], np.int32))
            t = time.perf_counter()
            c.async_stream_infer("sendbench", inputs, enable_empty_final_response=True)
            for _ in range(args.n + 1):
                error = q.get()
                assert error is None, error
            client_rows.append(
                dict(threads=k, client_us_per_response=round((time.perf_counter() - t) / args.n * 1e6, 1))
            )
            c.stop_stream()
            c.close()
    finally:
        server.stop()
    stub = [
        json.loads(m.group(2)) | {"kind": m.group(1)} for m in re.finditer(r"SENDCOST (\w+) (\{.*\})", log.read_text())
    ]
    result = dict(n=args.n, stub=stub, client=client_rows)
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
