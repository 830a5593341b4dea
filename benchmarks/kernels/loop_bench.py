"""One decode loop of the Ouro-1.4B shape (random bf16 weights, 24 layers over M rows at a context of
``--context`` tokens), captured as a CUDA graph and replayed alone, under variants of the kernels:

- ``variants``: the defaults against `kernels.rope_kv_attention` at every row count (``fused_attention``),
  the same without its reads ahead of the PDL wait (``fused_no_prefetch_kv``), RoPE + the KV write as their
  own kernel before attention (``unfused_attention``) and cuBLAS projections (``cublas``), with each
  output's largest difference to the defaults'.
- ``variants`` also runs two timing probes whose outputs are wrong on purpose: ``probe_no_norms`` (the
  sandwich norms launch nothing: what folding them into the next projection could gain at most) and
  ``probe_no_attention`` (RoPE, the KV write and attention launch nothing: attention's share of the loop);
  ``l2_gate_up_*``: the o projection asks L2 for that share of its layer's gate/up weight before its
  PDL wait (`projections.L2_AHEAD_TABLE` holds the measured shares); ``attn_s*_n*[_g*]``: the fused decode
  attention's split-KV factor, keys a tile and split grain. ``--names`` picks some (``default`` always runs
  first).
- ``tune``: the decode table in context. For each M and each projection shape, the table's config, cuBLAS
  and the fastest configs of a `linear_bench.py` sweep (``--sweep``, timed there in isolation) are timed in
  the loop with the other shapes as chosen so far (one pass of coordinate descent from the table). The loop
  can disagree with a whole engine: check the choices end to end with `bench_with_tune.py` before they go
  into the table.

    PYTHONPATH=$PWD python3 benchmarks/kernels/loop_bench.py variants --out loop_variants.json
    PYTHONPATH=$PWD python3 benchmarks/kernels/loop_bench.py tune --sweep linear_sweep.json --out loop_tune.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time

import torch

from benchmarks.graph_timing import replay_ms
from benchmarks.kernels.bench_kernels import rel_err
from ouro_backend import EngineConfig, LLMEngine
from ouro_backend.entrypoints.bench import ensure_shape_checkpoint
from ouro_backend.kernels import projections
from ouro_backend.kernels.attention import rope_kv_attention
from ouro_backend.kernels.backend import TritonBackend
from ouro_backend.kernels.projections import LinearConfig
from ouro_backend.model.attention import AttentionMetadata


class UnfusedAttention(TritonBackend):
    """RoPE + the KV write in their own kernel, then attention (the path of rounds with prompt chunks)."""

    rope_kv_attention = staticmethod(TritonBackend.rope_then_attention)


SHAPE_NAMES = {(6144, 2048): "qkv", (2048, 2048): "o", (11264, 2048): "gate_up", (2048, 5632): "down"}


class Loop:
    """The model's loop at M rows over a real paged KV cache, timed as a CUDA graph."""

    def __init__(self, context: int, max_rows: int):
        # The engine is only the model's holder: its own KV cache stays small (the loop reads self.kv), so that
        # the loop's cache fits at long contexts and many rows.
        opts = {"model": ensure_shape_checkpoint("ouro-1.4b"), "cuda_graphs": "0", "num_blocks": "256"}
        self.eng = LLMEngine(EngineConfig.from_strings(opts))
        m = self.m = self.eng.runner.model
        cfg = m.cfg
        self.bs, self.ctx = 16, context
        self.per_row = (context + self.bs - 1) // self.bs
        self.kv = torch.randn(
            cfg.num_hidden_layers, 2, max_rows * self.per_row, self.bs, cfg.num_key_value_heads, cfg.head_dim,
            device=m.device, dtype=m.dtype,
        )  # fmt: skip
        self.weight_bytes = sum(t.numel() * t.element_size() for ly in m.layers for t in vars(ly).values())

    def inputs(self, M: int):
        dev, bs, ctx = self.m.device, self.bs, self.ctx
        tables = torch.arange(M * self.per_row, device=dev, dtype=torch.int32).view(M, self.per_row)
        meta = AttentionMetadata(
            torch.arange(M + 1, device=dev, dtype=torch.int32),
            torch.full((M,), ctx, device=dev, dtype=torch.int32),
            tables,
            tables[:, -1].to(torch.int64) * bs + (ctx - 1) % bs,
            1,
            ctx,
        )
        pos = torch.full((M,), ctx - 1, device=dev, dtype=torch.int64)
        h = torch.randn(M, self.m.cfg.hidden_size, device=dev, dtype=self.m.dtype)
        return h, pos, meta

    @torch.inference_mode()
    def time(self, inputs, replays: int) -> tuple[float, torch.Tensor]:
        h, pos, meta = inputs
        self.m.loop(h.clone(), pos, meta, self.kv)  # compiles
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = self.m.loop(h.clone(), pos, meta, self.kv)
        ms = replay_ms(g, replays)
        return ms, out.clone()


class FusedAttention(TritonBackend):
    """`rope_kv_attention` for every decode round, whatever its rows (the default stops at a row count)."""

    prefetch_kv = True
    num_splits: int | None = None  # None: `auto_num_splits`; these five: `rope_kv_attention`'s overrides
    block_n: int | None = None
    split_grain: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None

    @classmethod
    def rope_kv_attention(cls, q, k, v, positions, cos_sin, k_cache, v_cache, meta, scale):
        return rope_kv_attention(
            q, k, v, positions, cos_sin, k_cache, v_cache, meta.slot_mapping, meta.cu_seqlens_q, meta.seq_lens,
            meta.block_tables, scale, num_splits=cls.num_splits, block_n=cls.block_n, split_grain=cls.split_grain,
            num_warps=cls.num_warps, num_stages=cls.num_stages, prefetch_kv=cls.prefetch_kv,
        )  # fmt: skip


class FusedAttentionNoPrefetch(FusedAttention):
    """The same with nothing read before the attention kernel's PDL wait: up to 16 rows (where the default
    fuses too) the difference to ``default`` is what ``prefetch_kv`` gains or loses in the loop."""

    prefetch_kv = False


class ProbeNoNorms(TritonBackend):
    """Timing probe, wrong results: the sandwich norms launch nothing (their inputs pass through)."""

    @staticmethod
    def sandwich_norm(x, residual, w_post, w_next, eps):
        return residual, x


class ProbeNoAttention(TritonBackend):
    """Timing probe, wrong results: RoPE, the KV write and attention launch nothing (an uninitialised output)."""

    @staticmethod
    def rope_kv_attention(q, k, v, positions, cos_sin, k_cache, v_cache, meta, scale):
        return torch.empty((q.shape[0], q.shape[1] * q.shape[2]), dtype=q.dtype, device=q.device)


def attn_split_variants() -> dict:
    """``attn_s<splits>_n<block_n>[_g<grain>]`` backends: the fused decode attention at every row count with that
    split-KV factor, keys a tile and split grain (default: the tile), instead of `attention.splits_for`'s factor
    and `_attn_config`'s tiles."""
    grid = ((1, 64, 0), (2, 64, 0), (4, 64, 0), (4, 32, 0), (4, 64, 32), (8, 64, 0), (8, 32, 0), (8, 64, 16))
    grid += ((16, 16, 0),)
    return {
        f"attn_s{s}_n{n}" + (f"_g{g}" if g else ""): type(
            "AttnSplits", (FusedAttention,), {"num_splits": s, "block_n": n, "split_grain": g or n}
        )
        for s, n, g in grid
    }


PROBES = {"probe_no_norms": ProbeNoNorms, "probe_no_attention": ProbeNoAttention}


class L2Ahead(TritonBackend):
    """The o projection asks L2 for ``share`` of the next weight the model names (its layer's gate/up) before
    its PDL wait, at every row count, instead of `projections.L2_AHEAD_TABLE`'s share."""

    share = 0.0

    @classmethod
    def linear(cls, x, w, next_weight=None, **kw):
        share = None if next_weight is None else cls.share
        return projections.linear(x, w, next_weight=next_weight, l2_share=share, **kw)


def l2_variants() -> dict:
    """``l2_gate_up_<percent>`` backends: o prefetches that share of its layer's gate/up weight, at every row
    count (``l2_gate_up_0``: none; the table's share is what ``default`` runs)."""
    return {f"l2_gate_up_{pct}": type("L2Ahead", (L2Ahead,), {"share": pct / 100}) for pct in (0, 10, 20, 30, 40, 50)}


def run_variants(loop: Loop, rows: list[int], replays: int, only: list[str] | None = None) -> dict:
    res: dict = {"loops_ms": {}}
    default = loop.m.backend
    backends = {
        "default": default,
        "fused_attention": FusedAttention,
        "fused_no_prefetch_kv": FusedAttentionNoPrefetch,
        "unfused_attention": UnfusedAttention,
        "cublas": default,  # with OURO_LINEAR=cublas
        **PROBES,
        **l2_variants(),
        **attn_split_variants(),
    }
    unknown = sorted(set(only or ()) - set(backends))
    if unknown:
        raise SystemExit(f"loop_bench variants: unknown names {unknown}; known: {', '.join(backends)}")
    names = [n for n in backends if not only or n in only]
    for M in rows:
        inputs, ref = loop.inputs(M), None
        for name in names:
            loop.m.backend = backends[name]
            os.environ["OURO_LINEAR"] = "cublas" if name == "cublas" else ""
            ms, out = loop.time(inputs, replays)
            ref = out if ref is None else ref
            res["loops_ms"].setdefault(name, {})[str(M)] = round(ms, 4)
            err = rel_err(out, ref)
            tag = f"max rel. difference to default {err:.1e}"
            tag = "timing probe: output wrong on purpose" if name in PROBES else tag
            print(f"M={M:3d} {name:20s} {ms:7.4f} ms  {loop.weight_bytes / ms / 1e6:6.0f} GB/s  {tag}", flush=True)
    loop.m.backend = default
    os.environ.pop("OURO_LINEAR", None)
    return res


@contextlib.contextmanager
def table_override(chosen: dict):
    """Within it, `linear()` runs ``chosen[(N, K, M)]`` (a config, or None for cuBLAS) where it has an entry and
    the table elsewhere: it looks the table up through `projections.config_for`. Yields the table's own lookup.
    `chosen` may change inside (the tune fills it as it goes)."""
    table_for = projections.config_for
    projections.config_for = lambda N, K, M: chosen[(N, K, M)] if (N, K, M) in chosen else table_for(N, K, M)
    try:
        yield table_for
    finally:
        projections.config_for = table_for


def tuned_choices(table: dict) -> dict:
    """A tune's ``table`` output ({shape name: {M: config fields or None}}) as (N, K, M) -> config or None."""
    shapes = {name: nk for nk, name in SHAPE_NAMES.items()}
    return {
        (*shapes[name], int(M)): None if c is None else LinearConfig(**c)
        for name, by_m in table.items()
        for M, c in by_m.items()
    }


def run_tune(loop: Loop, rows: list[int], replays: int, sweep_path: str, top: int) -> dict:
    sweep = json.load(open(sweep_path))["sweep"]
    ranked: dict = {}
    for row in sweep:
        good = sorted((c for c in row["configs"] if c.get("ok")), key=lambda c: c["us"])
        ranked[(row["N"], row["K"], row["M"])] = [LinearConfig(**c["config"]) for c in good[:top]]
    chosen: dict = {}  # (N, K, M) -> config or None
    res: dict = {"tune": []}
    with table_override(chosen) as table_for:
        for M in rows:
            inputs = loop.inputs(M)
            for N, K in SHAPE_NAMES:
                cands: list = [table_for(N, K, M), None]
                cands += [c for c in ranked.get((N, K, M), []) if c not in cands]
                times = []
                for c in cands:
                    chosen[(N, K, M)] = c
                    try:
                        ms, _ = loop.time(inputs, replays)
                    except Exception as e:  # a config the shape cannot take: recorded, not fatal
                        print(f"  {c}: {type(e).__name__}: {str(e)[:200]}")
                        continue
                    times.append((ms, c))
                best_ms, best = min(times, key=lambda t: t[0])
                chosen[(N, K, M)] = best
                entry = dict(
                    M=M,
                    shape=SHAPE_NAMES[(N, K)],
                    times={("cublas" if c is None else c.name): round(ms, 4) for ms, c in times},
                    table=None if cands[0] is None else cands[0].name,
                    best=None if best is None else best.name,
                )
                res["tune"].append(entry)
                print(f"M={M:3d} {SHAPE_NAMES[(N, K)]:8s} best {entry['best']} {best_ms:.4f} ms  {entry['times']}")
            print(f"M={M:3d} loop with the choices: {min(t[0] for t in times):.4f} ms", flush=True)
    res["table"] = {name: {} for name in SHAPE_NAMES.values()}
    for (N, K, M), c in chosen.items():
        res["table"][SHAPE_NAMES[(N, K)]][str(M)] = None if c is None else vars(c)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=("variants", "tune"))
    ap.add_argument("--out")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--rows", default="1,2,4,8,16,32,64")
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--sweep", help="tune: a linear_bench.py JSON")
    ap.add_argument("--names", help="variants: only these (comma-separated; the default always runs first)")
    ap.add_argument("--top", type=int, default=3, help="tune: the sweep's fastest configs to try")
    args = ap.parse_args()
    t0 = time.time()
    rows = [int(r) for r in args.rows.split(",")]
    loop = Loop(args.context, max(rows))
    res = {"context": args.context, "loop_weight_bytes": loop.weight_bytes, "device": torch.cuda.get_device_name()}
    if args.mode == "variants":
        only = ["default", *args.names.split(",")] if args.names else None
        res.update(run_variants(loop, rows, args.replays, only))
    else:
        res.update(run_tune(loop, rows, args.replays, args.sweep, args.top))
    res["elapsed_s"] = round(time.time() - t0, 1)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
