"""mixed-rows on the GPU: the scenario of test_fp32_mixed_row_graphs_equal_oracle, step by step, with
progress every 100 steps (unfinished requests: slot, tokens so far), faulthandler dumps every 30 s, and the
mixed graph each mixed round picked (rows, bound slots). Stops after 3,000 steps. Run from the branch tree."""
import faulthandler, os, subprocess, sys, time
sys.path.insert(0, "tests")
faulthandler.dump_traceback_later(30, repeat=True)
os.environ.setdefault("OURO_LINEAR", "kernel")
import torch
from engine_helpers import make_recording_engine as make_engine
from ouro_backend import SamplingParams
ck = "/tmp/toyckpt"
if not os.path.exists(ck + "/config.json"):
    subprocess.run([sys.executable, "-m", "ouro_backend.model.toy", "--out", ck], check=True, stdout=subprocess.DEVNULL)
from engine_helpers import ORACLE_PROMPTS as PROMPTS
layout = sys.argv[1] if len(sys.argv) > 1 else "last_exited"
eng = make_engine(ck, device=os.environ.get("DEV", "cuda"), dtype="float32", attention_backend="triton", kv_layout=layout,
                  max_num_seqs=32, prefill_chunk_size=5, max_num_batched_tokens=48)
eng.runner.record_logits = False
graphs = eng.runner.graphs
if graphs is None:
    class _G: mixed_graph = staticmethod(lambda *a: None)
    graphs = _G()
picked = graphs.mixed_graph
log = []
def recording(*args):
    got = picked(*args)
    log.append(None if got is None else (got[0].rows, got[1][:20]))
    return got
graphs.mixed_graph = recording
n = 24
arrivals = {3 * i: [i] for i in range(6)} | {18: list(range(6, 20))} | {30 + 3 * j: [20 + j] for j in range(4)}
outs, toks = {}, {}
t0 = time.time()
for step in range(3000):
    for i in arrivals.get(step, []):
        eng.add_request(str(i), PROMPTS[i % len(PROMPTS)],
                        SamplingParams(max_tokens=12 + i % 5, temperature=0.0, ignore_eos=True, exit_threshold=0.5))
    if not eng.has_unfinished_requests() and len(outs) == n:
        break
    nlog = len(log)
    res = eng.step()
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    for o in res:
        toks[o.request_id] = len(o.token_ids)
        if o.finished:
            outs[o.request_id] = o
    if step < 80 or step % 100 == 0:
        print(f"step {step} t={time.time()-t0:.2f}s finished={len(outs)} tokens={dict(sorted(toks.items(), key=lambda x: int(x[0])))} mixed={log[nlog:]}", flush=True)
print("END step", step, "finished", len(outs), "of", n, "unfinished:", sorted(set(map(str, range(n))) - set(outs), key=int))
print("stats", eng.stats())
