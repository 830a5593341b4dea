"""Decode projections on the GPU: cuBLAS against `kernels.projections.linear`'s candidate configs, the
measurement behind its `DECODE_TABLE`.

    PYTHONPATH=$PWD python3 benchmarks/kernels/linear_bench.py --out linear.json

1. Sweep: for each Ouro-1.4B/2.6B projection shape and M rows, cuBLAS and every candidate, each timed as a
   CUDA graph of 24 back-to-back calls over 24 distinct copies of the weight (a loop's layers: streamed from
   HBM, not L2), median of ``--replays`` replays (CUDA events), with programmatic dependent launch on (as
   the engine runs it) and, for the winner, off. The down projection is timed with the SiLU-mul fused
   (``silu_x``) against cuBLAS after the activation kernel: the pair the engine would otherwise run. Each
   candidate is checked against an fp32 product first; failures are recorded, not fatal.
2. Stack: 24 layers x (qkv, o, gate_up, down) with distinct weights in one graph: cuBLAS vs the winners,
   PDL on and off: the projections' share of a decode loop, against the weight-read floor.
Prints the winners as a `DECODE_TABLE` literal and writes everything to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import triton

from benchmarks.graph_timing import graph_ms
from ouro_backend.kernels.activation import silu_mul
from ouro_backend.kernels.projections import MAX_FMA_M, LinearConfig, linear

SHAPES = {"qkv": (6144, 2048), "o": (2048, 2048), "gate_up": (11264, 2048), "down": (2048, 5632)}
LAYERS = 24
T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def candidates(M: int, N: int, K: int) -> list[LinearConfig]:
    out = []
    if M <= MAX_FMA_M:
        for bn, bk, nw in ((16, 512, 8), (16, 256, 4), (32, 256, 8), (8, 512, 4)):
            for split in (1, 2):
                for pf in (True, False):
                    out.append(LinearConfig(bn, bk, split, nw, 1, dot=False, prefetch=pf))
    out.append(LinearConfig(16, 256, 1, 4, 4, dot=True))
    for bn, ns in ((32, 4), (64, 3)):
        for split in (1, 2, 4):
            out.append(LinearConfig(bn, 128, split, 4, ns, dot=True))
    chunks = lambda c: triton.cdiv(K, c.block_k)  # noqa: E731
    return [c for c in out if triton.cdiv(chunks(c), c.split_k) * (c.split_k - 1) < chunks(c)]


def set_pdl(on: bool) -> None:
    os.environ["OURO_PDL"] = "1" if on else "0"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--ms", default="1,2,4,8,16,32,64")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--hbm-tb-s", type=float, default=4.8)
    args = ap.parse_args()
    ms = [int(m) for m in args.ms.split(",")]
    dev = torch.device("cuda")
    torch.manual_seed(0)
    weights = {
        name: [torch.randn(N, K, device=dev, dtype=torch.bfloat16) / K**0.5 for _ in range(LAYERS)]
        for name, (N, K) in SHAPES.items()
    }
    report: dict = dict(device=torch.cuda.get_device_name(), triton=triton.__version__, sweep=[], stack={})
    best: dict = {}
    for name, (N, K) in SHAPES.items():
        if name not in args.shapes.split(","):
            continue
        silu_x = name == "down"
        ws = weights[name]
        wbytes = N * K * 2
        for M in ms:
            x = torch.randn(M, 2 * K if silu_x else K, device=dev, dtype=torch.bfloat16)
            ref = (silu_mul(x) if silu_x else x).float() @ ws[0].float().t()

            def cublas(x=x, ws=ws, silu_x=silu_x):
                for w in ws:
                    (silu_mul(x) if silu_x else x) @ w.t()

            set_pdl(True)
            row = dict(shape=name, N=N, K=K, M=M, cublas_us=graph_ms(cublas, args.replays) * 1e3 / LAYERS, configs=[])
            for cfg in candidates(M, N, K):
                try:
                    y = linear(x, ws[0], silu_x=silu_x, config=cfg)
                    err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                    ok = err < 2e-2
                    us = graph_ms(lambda cfg=cfg: [linear(x, w, silu_x=silu_x, config=cfg) for w in ws], args.replays)
                    row["configs"].append(dict(name=cfg.name, config=vars(cfg), err=err, ok=ok, us=us * 1e3 / LAYERS))
                except Exception as e:  # recorded, not fatal
                    row["configs"].append(dict(name=cfg.name, config=vars(cfg), ok=False, error=str(e)[:300]))
            good = [c for c in row["configs"] if c.get("ok")]
            win = min(good, key=lambda c: c["us"]) if good else None
            if win:
                cfg = LinearConfig(**win["config"])
                set_pdl(False)
                win["us_no_pdl"] = graph_ms(lambda: [linear(x, w, silu_x=silu_x, config=cfg) for w in ws], args.replays)
                win["us_no_pdl"] *= 1e3 / LAYERS
                set_pdl(True)
                win["tb_s"] = wbytes / win["us"] / 1e6
            row["cublas_tb_s"] = wbytes / row["cublas_us"] / 1e6
            row["best"] = win
            best[(name, M)] = LinearConfig(**win["config"]) if win and win["us"] < row["cublas_us"] else None
            report["sweep"].append(row)
            log(
                f"{name:7s} M={M:2d} cublas {row['cublas_us']:6.1f} us ({row['cublas_tb_s']:.2f} TB/s)  best "
                + (
                    f"{win['name']} {win['us']:6.1f} us ({win['tb_s']:.2f} TB/s, no PDL {win['us_no_pdl']:.1f})"
                    if win
                    else "-"
                )
            )
    # the layer stack: a decode loop's projections in order, distinct weights
    total_bytes = sum(N * K * 2 for N, K in SHAPES.values()) * LAYERS
    for M in ms:
        xs = {
            name: torch.randn(M, 2 * K if name == "down" else K, device=dev, dtype=torch.bfloat16)
            for name, (N, K) in SHAPES.items()
        }

        def stack(use_kernel: bool, M=M, xs=xs):
            for i in range(LAYERS):
                for name in SHAPES:
                    cfg = best.get((name, M)) if use_kernel else None
                    if cfg is None:
                        x = silu_mul(xs[name]) if name == "down" else xs[name]
                        x @ weights[name][i].t()
                    else:
                        linear(xs[name], weights[name][i], silu_x=name == "down", config=cfg)

        res = {}
        for label, use_kernel, pdl in (
            ("cublas", False, False),
            ("kernel_no_pdl", True, False),
            ("kernel_pdl", True, True),
        ):
            set_pdl(pdl)
            t = graph_ms(lambda use_kernel=use_kernel: stack(use_kernel), args.replays)
            res[label] = dict(us=t * 1e3, tb_s=total_bytes / t / 1e9)
        set_pdl(True)
        res["floor_us"] = total_bytes / args.hbm_tb_s / 1e6
        report["stack"][str(M)] = res
        log(
            f"stack M={M:2d} "
            + "  ".join(f"{k} {v['us']:.0f} us ({v['tb_s']:.2f} TB/s)" for k, v in res.items() if k != "floor_us")
            + f"  floor {res['floor_us']:.0f} us"
        )
    table = {}
    for (name, M), cfg in best.items():
        table.setdefault(SHAPES[name], []).append((M, cfg))
    report["table"] = {f"{N}x{K}": [(M, c.name if c else None) for M, c in rows] for (N, K), rows in table.items()}
    print("DECODE_TABLE winners by M:")
    for (N, K), rows in table.items():
        print(f"  ({N}, {K}): " + ", ".join(f"{M}: {c!r}" for M, c in rows))
    report["elapsed_s"] = time.time() - T0
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
