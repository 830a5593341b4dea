"""The greedy coda of a decode round at the Ouro-1.4B/2.6B LM head (vocab 49152, hidden 2048, bf16): the plain
coda the engine runs without the fused kernel (``h @ lm_head.T``, ``.float()``, argmax, log_softmax + gather)
against `kernels.coda.greedy_coda` at its table's config (``--sweep``: and a grid of others, CUDA-core configs
up to 8 rows, tensor-core ones beyond), in rounds where a row exits and in rounds where none does.

    PYTHONPATH=$PWD python3 benchmarks/kernels/coda_bench.py [--rows 1,2,4,8,16,64] [--sweep] [--hbm-tb-s 4.8] [--out F]

Each figure is the median over replays (`benchmarks/graph_timing.py`) of a CUDA graph holding `--calls`
back-to-back calls, divided by the calls (us per coda). ``pct_of_peak``: the LM head's bytes over that time
against ``--hbm-tb-s``. Tokens are checked against the plain coda's (bf16 logits can tie: a differing token
must be within one bf16 step of the maximum).
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from benchmarks.graph_timing import graph_ms
from ouro_backend.config import ExitMode
from ouro_backend.engine import decode_state as ds
from ouro_backend.engine.decode_state import DecodeState
from ouro_backend.kernels import coda
from ouro_backend.model.torch_ops import greedy_coda_ref


def _state(M: int, emit: bool, dev) -> DecodeState:
    """M active rows at loop 4 of 4 (they all exit) or at loop 1 with threshold 1.0 (none exits)."""
    st = DecodeState(M, 4, 8, 2048, torch.bfloat16, dev, block_size=16, last_exited=True, eos_ids=[], fused=True)
    st.ints[:, ds.ACTIVE] = 1
    st.ints[:, ds.LOOP] = 4 if emit else 1
    st.ints[:, ds.MIN_LOOPS] = 1
    st.ints[:, ds.MAX_LOOPS] = 4
    st.floats[:, ds.THRESHOLD] = 1.0
    return st


def _time(fn, calls: int, replays: int) -> float:
    """us per call: fn captured `calls` times in one CUDA graph, median over replays."""
    return graph_ms(lambda: [fn() for _ in range(calls)], replays) * 1000 / calls


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,16,64")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--sweep", action="store_true", help="every config of the grid below, not only the default")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--hbm-tb-s", type=float, default=4.8)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    w = (torch.randn(args.vocab, args.hidden, generator=gen, device=dev) / args.hidden**0.5).bfloat16()
    nbytes = w.numel() * w.element_size()
    fma_grid = itertools.product((8, 16, 32), (256, 512), (4, 8), (1, 2, 3, 4))
    fma = [coda.CodaConfig(v, k, nw, p) for v, k, nw, p in fma_grid]
    dot_grid = itertools.product((64, 128), (64, 128), (3, 4), (1, 2))
    dot = [coda.CodaConfig(v, k, 4, p, dot=True, num_stages=st) for v, k, st, p in dot_grid]
    rows = []

    def pct(us: float) -> float:
        return round(100 * nbytes / (us * 1e-6) / (args.hbm_tb_s * 1e12), 1)

    for M in (int(m) for m in args.rows.split(",")):
        h = torch.randn(M, args.hidden, generator=gen, device=dev).bfloat16()
        idx = torch.arange(M, device=dev)
        lam = torch.full((M,), 0.5, device=dev)
        plain_us = _time(lambda: greedy_coda_ref(h, w), args.calls, args.replays)
        ref_tok, ref_lp = greedy_coda_ref(h, w)
        logits = (h @ w.t()).float()
        row = {"rows": M, "plain_us": round(plain_us, 2), "plain_pct_of_peak": pct(plain_us), "configs": []}
        print(f"M={M} plain coda {plain_us:.2f} us ({pct(plain_us)}% of {args.hbm_tb_s} TB/s)", flush=True)
        emit, idle = _state(M, True, dev), _state(M, False, dev)
        sweep = (fma if M <= coda.MAX_FMA_M else dot) if args.sweep else []
        for cfg in [coda.coda_config(M)] + [c for c in sweep if c != coda.coda_config(M)]:  # the table's first
            try:

                def run(st=emit, cfg=cfg):
                    return coda.greedy_coda(h, w, st, idx, lam, ExitMode.OURO, ds.COLUMNS, cfg)

                tok, lp = run()
                top = logits.max(-1).values
                chosen = logits.gather(1, tok[:, None])[:, 0]
                ok = bool(torch.equal(tok, ref_tok) or (top - chosen <= top.abs() * 2**-7).all())
                lp_err = float((lp - ref_lp).abs().max())
                us = _time(run, args.calls, args.replays)
                skip_us = _time(lambda: run(idle), args.calls, args.replays)
                r = dict(
                    config=vars(cfg), us=round(us, 2), pct_of_peak=pct(us), skip_us=round(skip_us, 2), tokens_ok=ok
                )
                r["lp_max_err"] = lp_err
            except Exception as e:  # a config that does not compile or fit: recorded, the sweep goes on
                r = dict(config=vars(cfg), error=f"{type(e).__name__}: {str(e)[:300]}")
            row["configs"].append(r)
            print(f"  {cfg} -> {r}", flush=True)
        good = [c for c in row["configs"] if "us" in c and c["tokens_ok"]]
        if good:
            best = min(good, key=lambda c: c["us"])
            row["best"] = best
            print(f"M={M} best {best['config']} {best['us']} us ({best['pct_of_peak']}%), plain {plain_us:.2f}")
        rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            meta = {"vocab": args.vocab, "hidden": args.hidden, "hbm_tb_s": args.hbm_tb_s}
            json.dump({**meta, "device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
