"""Decode projections on the GPU: cuBLAS (``x @ w.t()``) vs ``skinny_matmul``'s candidate configs.

An experiment the engine does not use: on the H200 the best config per shape was at most 7% faster than
cuBLAS over 24 layers (907 against 969 us at 1 row, 2.72 against 2.55 TB/s) and slower at 64 rows
(benchmarks/results/2026-12-01-h200-early-exit-rows/, skinny_gemm.json), not worth a kernel family to keep.

    PYTHONPATH=$PWD python3 benchmarks/skinny_gemm/bench.py --out skinny.json

1. Sweep: for each Ouro-1.4B projection shape and M rows, cuBLAS and every ``candidate_configs`` entry,
   each timed as a CUDA graph of ``--calls`` back-to-back calls (launch gaps as in the engine's graphs;
   median over ``--replays`` replays, CUDA events). The calls cycle through enough copies of the weight
   (>= 256 MB) that it is streamed from HBM, not L2. Every config is checked against
   ``x.float() @ w.float().T`` (and split-K ones for bitwise reproducibility); failures are recorded, not
   fatal.
2. Layer stack (the number that matters): 24 layers x 4 projections with distinct weights (2.45 GB) in one
   graph, cuBLAS vs the sweep's best config per shape, vs the faster of the two per shape ("mixed").
Everything goes to ``--out`` as JSON. Takes ~1-2 minutes on an H200 (Triton compiles included).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel import SkinnyConfig, candidate_configs, skinny_matmul

SHAPES = {"qkv": (6144, 2048), "o": (2048, 2048), "gate_up": (11264, 2048), "down": (2048, 5632)}  # (N, K)
LAYERS = 24
TOL = 2e-2  # max |err| relative to max |ref|: bf16 rounding of the output is ~4e-3
T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def graph_us(fns: list[Callable[[], object]], calls: int, replays: int) -> float:
    """Median microseconds per call of a CUDA graph running ``calls`` calls, cycling through ``fns``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compiles, workspaces) outside the capture
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fns[i % len(fns)]()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) * 1e3 / calls)
    del g
    return statistics.median(times)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def gbps(M: int, N: int, K: int, us: float) -> float:
    return 2 * (N * K + M * K + M * N) / (us * 1e-6) / 1e9


def sweep(ms: list[int], calls: int, replays: int, sms: int) -> list[dict]:
    rows = []
    for name, (N, K) in SHAPES.items():
        copies = max(1, min(64, math.ceil(256e6 / (N * K * 2))))
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K**-0.5 for _ in range(copies)]
        for M in ms:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            ref = x.float() @ ws[0].float().t()
            row = dict(shape=name, N=N, K=K, M=M, weight_copies=copies, configs=[])
            row["cublas_err"] = rel_err(x @ ws[0].t(), ref)
            row["cublas_us"] = graph_us([lambda w=w: x @ w.t() for w in ws], calls, replays)
            row["cublas_gbps"] = gbps(M, N, K, row["cublas_us"])
            for cfg in candidate_configs(M, N, K, sms):
                r: dict[str, object] = dict(name=cfg.name, config=cfg.__dict__.copy())
                try:
                    y = skinny_matmul(x, ws[0], cfg)
                    r["err"] = rel_err(y, ref)
                    r["deterministic"] = bool(torch.equal(y, skinny_matmul(x, ws[0], cfg)))
                    r["us"] = graph_us([lambda w=w, c=cfg: skinny_matmul(x, w, c) for w in ws], calls, replays)
                    r["gbps"] = gbps(M, N, K, r["us"])
                    r["ok"] = r["err"] <= TOL and r["deterministic"]
                except Exception as e:
                    r.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
                row["configs"].append(r)
            good = [r for r in row["configs"] if r["ok"]]
            best = min(good, key=lambda r: r["us"]) if good else None
            row["best"] = best
            b = f"{best['us']:7.2f} us {best['gbps']:6.0f} GB/s {best['name']}" if best else "NONE OK"
            log(
                f"{name:8s} M={M:3d}  cuBLAS {row['cublas_us']:7.2f} us {row['cublas_gbps']:6.0f} GB/s | "
                f"best Triton {b}  ({len(good)}/{len(row['configs'])} ok)"
            )
            bad = [r for r in row["configs"] if not r["ok"]]
            for r in bad:
                log(f"    NOT OK {r['name']}: err={r.get('err')} det={r.get('deterministic')} {r.get('error', '')}")
            rows.append(row)
        del ws
        torch.cuda.empty_cache()
    return rows


def print_tables(rows: list[dict], ms: list[int]) -> dict[int, dict]:
    print(
        f"\n{'shape':8s} {'M':>3s} {'cuBLAS us':>10s} {'GB/s':>6s} {'Triton us':>10s} {'GB/s':>6s} "
        f"{'speedup':>7s}  best config"
    )
    for r in rows:
        b = r["best"]
        if b:
            print(
                f"{r['shape']:8s} {r['M']:3d} {r['cublas_us']:10.2f} {r['cublas_gbps']:6.0f} {b['us']:10.2f} "
                f"{b['gbps']:6.0f} {r['cublas_us'] / b['us']:7.2f}  {b['name']}"
            )
        else:
            print(f"{r['shape']:8s} {r['M']:3d} {r['cublas_us']:10.2f} {r['cublas_gbps']:6.0f}   (no valid config)")
    layer = {}
    print(
        f"\none layer (4 shapes, each timed alone)\n{'M':>3s} {'cuBLAS us':>10s} {'Triton us':>10s} "
        f"{'mixed us':>9s} {'speedup':>7s}"
    )
    for M in ms:
        rs = [r for r in rows if r["M"] == M]
        cb = sum(r["cublas_us"] for r in rs)
        tr = sum(r["best"]["us"] if r["best"] else r["cublas_us"] for r in rs)
        mx = sum(min(r["cublas_us"], r["best"]["us"]) if r["best"] else r["cublas_us"] for r in rs)
        layer[M] = dict(cublas_us=cb, triton_us=tr, mixed_us=mx)
        print(f"{M:3d} {cb:10.2f} {tr:10.2f} {mx:9.2f} {cb / tr:7.2f}")
    return layer


def stack(ms: list[int], rows: list[dict], replays: int) -> dict[int, dict]:
    """24 layers x 4 projections, distinct weights, one graph per variant."""
    log(f"layer stack: allocating {LAYERS} x 4 weights")
    weights = [
        {n: torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K**-0.5 for n, (N, K) in SHAPES.items()}
        for _ in range(LAYERS)
    ]
    total_bytes = sum(w.numel() * 2 for layer in weights for w in layer.values())
    out = {}
    for M in ms:
        xs = {n: torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for n, (N, K) in SHAPES.items()}
        best: dict[str, dict | None] = {n: None for n in SHAPES}
        for r in rows:
            if r["M"] == M and r["best"]:
                best[r["shape"]] = r
        cfgs = {n: SkinnyConfig(**b["best"]["config"]) if b else None for n, b in best.items()}
        use_triton_mixed = {n: bool(b) and b["best"]["us"] < b["cublas_us"] for n, b in best.items()}

        def fns(mode: str) -> list[Callable[[], object]]:
            out_fns = []
            for layer in weights:
                for n, w in layer.items():
                    tri = cfgs[n] is not None and (mode == "triton" or (mode == "mixed" and use_triton_mixed[n]))
                    if tri:
                        out_fns.append(lambda x=xs[n], w=w, c=cfgs[n]: skinny_matmul(x, w, c))
                    else:
                        out_fns.append(lambda x=xs[n], w=w: x @ w.t())
            return out_fns

        res = dict(
            configs={n: (c.name if c else None) for n, c in cfgs.items()},
            mixed_uses_triton=use_triton_mixed,
            weight_bytes=total_bytes,
        )
        for mode in ("cublas", "triton", "mixed"):
            f = fns(mode)
            us = graph_us(f, len(f), replays) * len(f)  # whole stack per replay
            res[f"{mode}_us"] = us
            res[f"{mode}_tbps"] = total_bytes / (us * 1e-6) / 1e12
        out[M] = res
        log(
            f"stack M={M:3d}: cuBLAS {res['cublas_us']:8.1f} us ({res['cublas_tbps']:.2f} TB/s) | Triton "
            f"{res['triton_us']:8.1f} us ({res['triton_tbps']:.2f} TB/s) | mixed {res['mixed_us']:8.1f} us "
            f"({res['mixed_tbps']:.2f} TB/s)  speedup {res['cublas_us'] / res['triton_us']:.2f}x"
        )
    weights.clear()
    torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON results")
    ap.add_argument("--ms", default="1,2,4,8,16,32,64", help="rows M for the sweep")
    ap.add_argument("--stack-ms", default="1,8,16,32,64", help="rows M for the layer stack ('' = skip)")
    ap.add_argument("--calls", type=int, default=50, help="calls per graph in the sweep")
    ap.add_argument("--replays", type=int, default=7)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("unset TRITON_INTERPRET", file=sys.stderr)
        return 2
    import triton

    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    ms = [int(m) for m in args.ms.split(",") if m]
    stack_ms = [int(m) for m in args.stack_ms.split(",") if m]
    log(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, triton {triton.__version__}")
    rows = sweep(ms, args.calls, args.replays, props.multi_processor_count)
    layer = print_tables(rows, ms)
    stk = stack(stack_ms, rows, args.replays) if stack_ms else {}
    if stk:
        print(
            f"\nlayer stack ({LAYERS} layers x 4 projections, distinct weights)\n{'M':>3s} {'cuBLAS us':>10s} "
            f"{'TB/s':>5s} {'Triton us':>10s} {'TB/s':>5s} {'mixed us':>9s} {'TB/s':>5s} {'speedup':>7s}"
        )
        for M, r in stk.items():
            print(
                f"{M:3d} {r['cublas_us']:10.1f} {r['cublas_tbps']:5.2f} {r['triton_us']:10.1f} "
                f"{r['triton_tbps']:5.2f} {r['mixed_us']:9.1f} {r['mixed_tbps']:5.2f} "
                f"{r['cublas_us'] / r['triton_us']:7.2f}"
            )
    result = dict(
        device=props.name,
        sms=props.multi_processor_count,
        torch=torch.__version__,
        triton=triton.__version__,
        calls=args.calls,
        replays=args.replays,
        sweep=rows,
        layer_sum={str(k): v for k, v in layer.items()},
        stack={str(k): v for k, v in stk.items()},
        best={f"{r['shape']}/M={r['M']}": (r["best"]["name"] if r["best"] else None) for r in rows},
        elapsed_s=time.time() - T0,
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
