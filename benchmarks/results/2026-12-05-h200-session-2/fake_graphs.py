"""CPU emulation of the engine's CUDA-graph path, run on the `mixed-rows` branch's tree: a capture remembers the
round function and its record, a replay zeroes the record and runs the function again, and the read-back
copies the record (on a GPU the pinned copy does). Runs tests/test_gpu.py's mixed-row scenario (24 requests,
32 slots, chunks of 5) and prints how many finished
(tokens are not compared with the oracle here). From the branch's tree, with the toy checkpoint:

    python3 -m ouro_backend.model.toy --out /tmp/toyckpt
    PYTHONPATH=$PWD OURO_LINEAR=kernel python3 fake_graphs.py /tmp/toyckpt [layout]   # ONLY=16|32|none: one graph size
    BACKEND=triton TRITON_INTERPRET=1 ...                                              # the Triton backend, interpreted

The capture lambdas must bind their loop variables (`rows=rows, pre=pre, ...`) for a replay that calls them again.
"""

import os
import sys

import torch

sys.path.insert(0, "tests")
from engine_helpers import ORACLE_PROMPTS as PROMPTS

from ouro_backend import SamplingParams
from ouro_backend.config import EngineConfig
from ouro_backend.engine import cuda_graphs as cg
from ouro_backend.engine.llm_engine import LLMEngine
from ouro_backend.engine.staging import Staging

torch.cuda.synchronize = lambda *a, **k: None
torch.cuda.memory_reserved = lambda *a, **k: 0


def fake_capture(self, fn, rounds):
    for _ in range(2):
        fn(self.state.new_record(rounds))
    rec = self.state.new_record(rounds)
    result = fn(rec)

    class G:
        def replay(_):
            rec.zero_()
            fn(rec)

    return G(), rec, result


cg.CudaGraphs._capture = fake_capture
Staging.readback = lambda self, t: (t.clone(), None)  # a graph's record is reused by its next replay


def engine(path, **kw):
    eng = LLMEngine(
        EngineConfig(
            model=path,
            block_size=4,
            device="cpu",
            dtype="float32",
            num_blocks=512,
            attention_backend=os.environ.get("BACKEND", "torch"),
            **kw,
        )
    )
    cfg = eng.config
    eng.runner.capture_graphs(
        cfg.max_num_seqs, min(cfg.cuda_graph_max_tokens, cfg.max_num_batched_tokens), cfg.decode_rounds_per_launch
    )
    return eng


if __name__ == "__main__":
    path = sys.argv[1]
    layout = sys.argv[2] if len(sys.argv) > 2 else "last_exited"
    eng = engine(path, kv_layout=layout, max_num_seqs=32, prefill_chunk_size=5, max_num_batched_tokens=48)
    graphs = eng.runner.graphs
    picked = graphs.mixed_graph
    used = []
    only = os.environ.get("ONLY")

    def rec_(*a):
        g = picked(*a)
        if g is not None and only and str(g[0].rows) != only:
            g = None
        used.append(None if g is None else g[0].rows)
        return g

    graphs.mixed_graph = rec_
    n = 24
    arrivals = {3 * i: [i] for i in range(6)} | {18: list(range(6, 20))} | {30 + 3 * j: [20 + j] for j in range(4)}
    outs = {}
    for step in range(600):
        for i in arrivals.get(step, []):
            eng.add_request(
                str(i),
                PROMPTS[i % len(PROMPTS)],
                SamplingParams(max_tokens=12 + i % 5, temperature=0.0, ignore_eos=True, exit_threshold=0.5),
            )
        if not eng.has_unfinished_requests() and len(outs) == n:
            break
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
    print(
        "steps",
        step,
        "finished",
        len(outs),
        "rows used",
        sorted(set(used), key=str),
        eng.stats().get("graph_launches"),
        eng.stats().get("eager_launches"),
    )
    unf = [s for s in eng.scheduler.running]
    for s in unf[:10]:
        print("unfinished", s.request_id, "slot", s.slot, "out", len(s.output_ids), "in_prefill", s.in_prefill)
