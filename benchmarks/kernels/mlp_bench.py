"""The decode MLP's two projections (Ouro-1.4B/2.6B shape: hidden 2048, MLP 5632) on the GPU: where SiLU-mul
goes, and configs for the pair. Every time is one CUDA graph of 24 back-to-back calls over 24 distinct layers'
weights (streamed from HBM, not L2), median of ``--replays`` replays, reported per layer.

    PYTHONPATH=$PWD python3 benchmarks/kernels/mlp_bench.py --out mlp.json

1. ``pair``: at the table's configs, gate/up then down with the activation in down's x load (``silu_x``)
   against in gate/up's epilogue (``glu``), with gate/up alone both ways and whether the two outputs are
   bitwise equal.
2. ``down``: the down projection alone at 1-8 rows over candidate configs, with x already activated (what
   runs after a GLU gate/up) and with the activation in its x load.
3. ``gate_up``: at rows where the table runs gate/up on cuBLAS, `kernels.mlp` as it runs now against the
   pair with gate/up on candidate kernel configs with GLU (then down at its table config).
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.graph_timing import graph_ms
from ouro_backend.kernels.projections import LinearConfig, _dot, _fma, config_for, linear, mlp

H, I, LAYERS = 2048, 5632, 24


def name(cfg: LinearConfig | None) -> str:
    return cfg.name if cfg else "cublas"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--replays", type=int, default=40)
    ap.add_argument("--hbm-tb-s", type=float, default=4.8)
    ap.add_argument("--sections", default="pair,down,gate_up", help="which of the three to run")
    args = ap.parse_args()
    sections = args.sections.split(",")
    dev = torch.device("cuda")
    torch.manual_seed(0)
    gus = [torch.randn(2 * I, H, device=dev, dtype=torch.bfloat16) / H**0.5 for _ in range(LAYERS)]
    dns = [torch.randn(H, I, device=dev, dtype=torch.bfloat16) / I**0.5 for _ in range(LAYERS)]
    per_layer = lambda fn: graph_ms(fn, args.replays) * 1e3 / LAYERS  # noqa: E731
    out: dict = dict(device=torch.cuda.get_device_name(), pair=[], down=[], gate_up=[])

    for M in (1, 2, 4, 8, 12, 16) if "pair" in sections else ():
        x = torch.randn(M, H, device=dev, dtype=torch.bfloat16)
        a, b = linear(linear(x, gus[0], glu=True), dns[0]), linear(linear(x, gus[0]), dns[0], silu_x=True)
        row = dict(
            M=M,
            gate_up=name(config_for(2 * I, H, M)),
            down=name(config_for(H, I, M)),
            silu_x_us=per_layer(lambda: [linear(linear(x, g), d, silu_x=True) for g, d in zip(gus, dns)]),
            glu_us=per_layer(lambda: [linear(linear(x, g, glu=True), d) for g, d in zip(gus, dns)]),
            gate_up_us=per_layer(lambda: [linear(x, g) for g in gus]),
            gate_up_glu_us=per_layer(lambda: [linear(x, g, glu=True) for g in gus]),
            bitwise_same=bool(torch.equal(a, b)),
            max_abs_diff=(a.float() - b.float()).abs().max().item(),
        )
        out["pair"].append(row)
        print(json.dumps(row), flush=True)

    for M in (1, 2, 4, 8) if "down" in sections else ():
        x1 = torch.randn(M, I, device=dev, dtype=torch.bfloat16)
        x2 = torch.randn(M, 2 * I, device=dev, dtype=torch.bfloat16)
        cands = [config_for(H, I, M)] + [_fma(bn, bk, s, 4) for bn, bk, s in ((8, 512, 2), (8, 256, 2), (4, 512, 2))]
        cands += [_fma(bn, bk, s, 4) for bn, bk, s in ((4, 256, 2), (8, 512, 1), (16, 256, 2), (8, 256, 4))]
        cands += [_fma(4, 256, 4, 4), _fma(16, 512, 2, 8), _fma(8, 1024, 2, 4), _fma(4, 1024, 1, 4)]
        cands += [_dot(32, 128, 4, 4, 4), _dot(16, 128, 4, 4, 6), _dot(32, 256, 2, 4, 4)]
        seen: set = set()
        for cfg in cands:
            if cfg is None or cfg.name in seen:
                continue
            seen.add(cfg.name)
            try:
                plain = per_layer(lambda: [linear(x1, w, config=cfg) for w in dns])
                silu = per_layer(lambda: [linear(x2, w, silu_x=True, config=cfg) for w in dns])
            except Exception as e:  # recorded, not fatal
                print("failed", M, cfg.name, str(e)[:200], flush=True)
                continue
            pct = H * I * 2 / plain / (args.hbm_tb_s * 1e6) * 100
            row = dict(M=M, cfg=cfg.name, plain_us=plain, silu_x_us=silu, plain_pct_of_hbm=pct)
            out["down"].append(row)
            print(json.dumps(row), flush=True)

    for M in (2, 4, 8, 32, 64) if "gate_up" in sections else ():
        x = torch.randn(M, H, device=dev, dtype=torch.bfloat16)
        now = per_layer(lambda: [mlp(x, g, d) for g, d in zip(gus, dns)])
        out["gate_up"].append(dict(M=M, cfg="mlp as the table runs it", gate_up=name(config_for(2 * I, H, M)), us=now))
        print(json.dumps(out["gate_up"][-1]), flush=True)
        cands = [_dot(64, 128, 2, 4, 3), _dot(32, 128, 1, 4, 4), _dot(64, 128, 1, 4, 4), _dot(128, 128, 1, 4, 4)]
        cands += [_dot(64, 64, 1, 4, 5), _dot(128, 64, 1, 8, 4), _dot(128, 128, 1, 8, 3)]
        if M <= 8:
            cands = [_fma(4, 512, 1, 4, defer_sum=True), _fma(8, 256, 1, 4), _fma(16, 256, 1, 4)] + cands
        for cfg in cands:
            try:
                us = per_layer(lambda: [linear(linear(x, g, glu=True, config=cfg), d) for g, d in zip(gus, dns)])
            except Exception as e:
                print("failed", M, cfg.name, str(e)[:200], flush=True)
                continue
            out["gate_up"].append(dict(M=M, cfg=cfg.name, us=us))
            print(json.dumps(out["gate_up"][-1]), flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
