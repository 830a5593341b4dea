"""Decode attention's launch config at 8-64 rows: a sweep timed alone, then its best few inside the decode loop.

Up to `backend.FUSED_ROPE_MAX_ROWS` rows the engine runs `rope_kv_attention` (RoPE + KV write + attention in one
kernel), above it `paged_attention` after the rope kernel; both take their tile (``block_n``), warps, stages and
split-KV factor from `attention._attn_config` / `auto_num_splits` unless told. For each (rows, context):

1. every config of the grid, timed alone: 24 launches (one per layer, each over its own layer's KV, so the reads
   come from HBM) captured as one CUDA graph, reported as us a launch and the KV bytes' share of ``--hbm-tb-s``;
   each output is compared with the default config's;
2. at ``--loop-context``, right after each row count's sweep: the default and the ``--top`` fastest configs in
   one decode loop of the 1.4B shape (`loop_bench.Loop`: 24 layers, random bf16 weights), where the kernel runs
   between the projections (PDL).

`bench_kernels.py --sweep` also sweeps `paged_attention`'s configs, one launch at a time under
`triton.testing.do_bench` (L2 flushed, launch overhead included): at these few-microsecond kernels that ranks
launch costs as much as the kernel; here the launches replay back to back in a graph, as in the engine, and
the fused kernel is swept too.

    PYTHONPATH=$PWD python3 benchmarks/kernels/attn_sweep.py --rows 8,16,32,64 --contexts 192,1024 --out attn.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch

from benchmarks.graph_timing import graph_ms
from benchmarks.kernels.bench_kernels import rel_err
from benchmarks.kernels.loop_bench import FusedAttention, Loop
from ouro_backend.kernels import build_cos_sin_cache
from ouro_backend.kernels.attention import paged_attention, rope_kv_attention
from ouro_backend.kernels.backend import FUSED_ROPE_MAX_ROWS, TritonBackend

LAYERS, KVH, HD, BS = 24, 16, 128, 16
GRID = [
    dict(block_n=bn, num_warps=w, num_stages=s, num_splits=sp)
    for bn, w, s, sp in itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4), (1, 2))
]


class Case:
    """Random caches of 24 layers for ``rows`` decode rows at ``ctx`` positions, and the engine's call at that
    row count (fused up to FUSED_ROPE_MAX_ROWS rows). ``live``: only the first this many rows hold keys; the
    others are idle rows of ``idle_len`` keys (as a graph's rows past those running: 1 in the engine's decode
    inputs, 0 a pad row), all on block 0."""

    def __init__(self, rows: int, ctx: int, live: int | None = None, idle_len: int = 1):
        dev, dt = torch.device("cuda"), torch.bfloat16
        live = rows if live is None else live
        per_row = (ctx + BS - 1) // BS
        self.kv = torch.randn(LAYERS, 2, max(live, 1) * per_row, BS, KVH, HD, device=dev, dtype=dt)
        self.tables = torch.zeros(rows, per_row, device=dev, dtype=torch.int32)
        self.tables[:live] = torch.arange(live * per_row, device=dev, dtype=torch.int32).view(live, per_row)
        self.cu = torch.arange(rows + 1, device=dev, dtype=torch.int32)
        self.lens = torch.full((rows,), idle_len, device=dev, dtype=torch.int32)
        self.lens[:live] = ctx
        self.q = torch.randn(rows, KVH, HD, device=dev, dtype=dt)
        self.k, self.v = torch.randn(2, rows, KVH, HD, device=dev, dtype=dt)
        self.pos = torch.full((rows,), ctx - 1, device=dev, dtype=torch.int64)
        self.slots = self.tables[:, -1].to(torch.int64) * BS + (ctx - 1) % BS
        self.cos_sin = build_cos_sin_cache(ctx, HD, 10000.0, device=dev)
        self.out = torch.empty_like(self.q)
        self.fused = rows <= FUSED_ROPE_MAX_ROWS
        self.bytes = LAYERS * live * ctx * 2 * KVH * HD * 2

    def call(self, layer: int, cfg: dict) -> None:
        kc, vc = self.kv[layer, 0], self.kv[layer, 1]
        if self.fused:
            rope_kv_attention(
                self.q, self.k, self.v, self.pos, self.cos_sin, kc, vc, self.slots, self.cu, self.lens, self.tables,
                HD**-0.5, out=self.out, prefetch_kv=True, **cfg,
            )  # fmt: skip
        else:
            paged_attention(self.q, kc, vc, self.cu, self.lens, self.tables, HD**-0.5, 1, out=self.out, **cfg)

    def time_us(self, cfg: dict, replays: int) -> float:
        return graph_ms(lambda: [self.call(layer, cfg) for layer in range(LAYERS)], replays) * 1e3 / LAYERS


def config_backend(cfg: dict | None) -> type:
    """The Triton backend with decode attention launched with ``cfg`` (None: the defaults): the fused kernel
    up to FUSED_ROPE_MAX_ROWS rows (`loop_bench.FusedAttention`), else RoPE + KV write then `paged_attention`,
    as the engine splits them."""
    if cfg is None:
        return TritonBackend

    class Configured(FusedAttention):
        @classmethod
        def rope_kv_attention(cls, q, k, v, positions, cos_sin, k_cache, v_cache, meta, scale):
            if q.shape[0] <= FUSED_ROPE_MAX_ROWS:
                return super().rope_kv_attention(q, k, v, positions, cos_sin, k_cache, v_cache, meta, scale)
            cls.rope_and_write_kv(q, k, v, positions, cos_sin, k_cache, v_cache, meta.slot_mapping)
            return paged_attention(
                q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, scale, 1, **cfg
            )

    for key, value in cfg.items():
        setattr(Configured, key, value)
    return Configured


def name(cfg: dict | None) -> str:
    if cfg is None:
        return "default"
    grain = f"_g{cfg['split_grain']}" if cfg.get("split_grain") else ""
    return f"n{cfg['block_n']}_w{cfg['num_warps']}_st{cfg['num_stages']}_s{cfg['num_splits']}{grain}"


def parse(label: str) -> dict:
    """`name`'s inverse: ``n64_w2_st3_s1`` -> the config (``_g256``: splits of multiples of 256 keys)."""
    n, w, st, sp, *grain = label.split("_")
    cfg = dict(block_n=int(n[1:]), num_warps=int(w[1:]), num_stages=int(st[2:]), num_splits=int(sp[1:]))
    if grain:
        cfg["split_grain"] = int(grain[0][1:])
    return cfg


def sweep(case: Case, grid: list[dict], replays: int) -> list[tuple[float, dict | None]]:
    """(us a launch, config) of the default (None) and every config of ``grid`` that runs and agrees with it,
    fastest first."""
    case.call(0, {})
    ref = case.out.float().clone()
    times: list[tuple[float, dict | None]] = [(case.time_us({}, replays), None)]
    for cfg in grid:
        try:
            us = case.time_us(cfg, replays)
        except Exception as e:  # a config the kernel cannot take (shared memory): recorded, not fatal
            print(f"  {name(cfg)}: {type(e).__name__}: {str(e)[:120]}")
            continue
        case.call(0, cfg)
        err = rel_err(case.out, ref)
        if err > 2e-2:
            print(f"  {name(cfg)}: differs from the default by {err:.1e}; dropped")
            continue
        times.append((us, cfg))
    return sorted(times, key=lambda t: t[0])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="8,16,32,64")
    ap.add_argument("--contexts", default="192,1024")
    ap.add_argument("--grid", help="only these configs (comma-separated names as printed, e.g. n64_w2_st3_s1)")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--top", type=int, default=3)
    ap.add_argument("--hbm-tb-s", type=float, default=4.8)
    ap.add_argument("--loop-context", type=int, default=0, help="the loop check's context (0: the first swept)")
    ap.add_argument("--skip-loop", action="store_true")
    ap.add_argument(
        "--live",
        default="",
        help="comma-separated: rows that hold keys (default all; the rest idle; counts above --rows are skipped); "
        "the loop check runs only for all rows live",
    )
    ap.add_argument("--idle-len", type=int, default=1, help="keys of an idle row (1 as the engine, 0 a pad row)")
    ap.add_argument("--out", help="JSON, rewritten after every case (a call cut short keeps what it measured)")
    args = ap.parse_args()
    t0 = time.time()
    rows_list = [int(r) for r in args.rows.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    grid = [parse(g) for g in args.grid.split(",")] if args.grid else GRID
    loop_ctx = args.loop_context or contexts[0]
    loop = None if args.skip_loop else Loop(loop_ctx, max(rows_list))
    res: dict = {"device": torch.cuda.get_device_name(), "hbm_tb_s": args.hbm_tb_s, "alone": [], "loop": []}
    lives = [int(x) for x in args.live.split(",")] if args.live else [None]
    for ctx, rows, live in itertools.product(contexts, rows_list, lives):
        if live is not None and live > rows:
            continue
        case = Case(rows, ctx, live, args.idle_len)
        times = sweep(case, grid, args.replays)
        per_launch = case.bytes // LAYERS
        pct = lambda us: round(100 * per_launch / (us * 1e-6) / (args.hbm_tb_s * 1e12), 1)  # noqa: E731
        dflt = next(us for us, c in times if c is None)
        row = dict(
            rows=rows,
            live=rows if live is None else live,
            context=ctx,
            fused=case.fused,
            kv_bytes_a_launch=per_launch,
            default_us=round(dflt, 2),
            default_pct_of_hbm=pct(dflt),
            ranked=[dict(config=name(c), us=round(us, 2), pct_of_hbm=pct(us)) for us, c in times],
        )
        res["alone"].append(row)
        top = ", ".join(f"{r['config']} {r['us']} ({r['pct_of_hbm']}%)" for r in row["ranked"][:4])
        head = f"rows={rows:3d} live={row['live']:3d} ctx={ctx:5d}"
        print(f"{head} default {dflt:7.2f} us ({pct(dflt)}%) | best: {top}", flush=True)
        del case
        torch.cuda.empty_cache()
        if loop is not None and ctx == loop_ctx and live is None:
            cands = [None, *[c for _, c in times if c is not None][: args.top]]
            inputs, ref_out = loop.inputs(rows), None
            for cfg in cands:
                loop.m.backend = config_backend(cfg)
                ms, out = loop.time(inputs, 30)
                ref_out = out if ref_out is None else ref_out
                err = rel_err(out, ref_out)
                res["loop"].append(dict(rows=rows, context=ctx, config=name(cfg), loop_ms=round(ms, 4), diff=err))
                print(f"loop rows={rows:3d} ctx={ctx:5d} {name(cfg):22s} {ms:.4f} ms (diff {err:.1e})", flush=True)
            loop.m.backend = TritonBackend
        res["elapsed_s"] = round(time.time() - t0, 1)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
