"""GPU check + benchmark of ``ouro_backend.kernels`` at Ouro-1.4B shapes.

    python benchmarks/kernels/bench_kernels.py [--out results.json] [--quick] [--sweep] [--no-graph]

For every kernel: run it once against its torch reference (bf16, H=16, kvh=16, hd=128, hidden 2048,
intermediate 5632, block_size 16), then time it with ``triton.testing.do_bench`` (median, L2 flushed
between runs) and report bytes moved, achieved GB/s and % of the H200's 4.8 TB/s HBM peak. Where a
plain-PyTorch equivalent exists it is timed too (``torch_us``; for attention: SDPA over a contiguous cache).
``--sweep`` also tries a grid of attention launch configs (a few minutes) and reports the best per case.
A CUDA-graph check captures rope+KV write, decode attention (split-K) and the sandwich norm, replays with
changed lengths/slots, and compares with eager references. Exit status 1 if any check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback

import torch

HBM_PEAK = 4.8e12  # bytes/s, H200
H, KVH, HD, HIDDEN, INTER, BS, LAYERS = 16, 16, 128, 2048, 5632, 16, 24
DT = torch.bfloat16
EPS = 1e-6
CTX = 1152  # decode context
DECODE_BATCHES = (1, 16, 64, 128)
PREFILL = (8, 1024)  # rows x tokens
MIXED = (512, 1024, 63)  # prompt chunk, its seq_len, decode rows (at CTX)
TOKENS = (64, 8192)  # N for norms / rope / kv writes / silu
MAX_POS = 65536
GRAPH_BATCHES = (4, 16)  # B=4 exercises split-K (auto) on an H200


def _bench(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3  # us


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Max abs difference over ref's max magnitude (inf if ``got`` is not finite)."""
    got, ref = got.float(), ref.float()
    if not torch.isfinite(got).all():
        return float("inf")
    return ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def _ulp_stats(got: torch.Tensor, ref: torch.Tensor) -> dict:
    a = got.to(torch.bfloat16).view(torch.int16).to(torch.int32)
    b = ref.to(torch.bfloat16).view(torch.int16).to(torch.int32)
    d = (a - b).abs()
    return {
        "max_ulp": int(d.max().item()),
        "exact_frac": float((d == 0).float().mean().item()),
        "finite": bool(torch.isfinite(got.float()).all().item()),
    }


def _ulp_ok(st: dict, max_ulp=1, min_exact=0.99) -> bool:
    return st["finite"] and st["max_ulp"] <= max_ulp and st["exact_frac"] >= min_exact


def _paged_batch(ns, seq_lens, dev, gen, dtype=DT):
    """Random caches sized for the batch, random (non-contiguous) block tables."""
    R = len(ns)
    nblk = [-(-L // BS) for L in seq_lens]
    total = sum(nblk) + 8
    perm = torch.randperm(total, generator=gen, device="cpu")
    max_blocks = max(nblk)
    bt = torch.zeros(R, max_blocks, dtype=torch.int32)
    c = 0
    for r, nb in enumerate(nblk):
        bt[r, :nb] = perm[c : c + nb].to(torch.int32)
        c += nb
    kc = torch.randn(total, BS, KVH, HD, device=dev, dtype=dtype)
    vc = torch.randn(total, BS, KVH, HD, device=dev, dtype=dtype)
    N = sum(ns)
    q = torch.randn(N, H, HD, device=dev, dtype=dtype)
    cu = torch.zeros(R + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(ns), 0)
    return q, kc, vc, cu.to(dev), torch.tensor(seq_lens, dtype=torch.int32, device=dev), bt.to(dev)


def _gather_dense(kc, vc, bt, seq_len_max, R):
    """Contiguous [R, H, L, hd] K/V for the SDPA baseline."""
    pos = torch.arange(seq_len_max, device=kc.device)
    blocks = bt.long()[:, pos // BS]  # [R, L]
    k = kc[blocks, pos % BS]  # [R, L, kvh, hd]
    v = vc[blocks, pos % BS]
    return k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()


class Runner:
    def __init__(self, args):
        self.args = args
        self.rows = []
        self.failed = False

    def record(self, name, shape, fn=None, nbytes=None, check=None, ok=True, torch_fn=None, flops=None, extra=None):
        row = {"name": name, "shape": shape, "ok": bool(ok), "check": check or {}}
        try:
            if fn is not None:
                us = _bench(fn)
                row["us"] = us
                if nbytes:
                    row["bytes"] = int(nbytes)
                    row["GBps"] = nbytes / (us * 1e-6) / 1e9
                    row["pct_hbm_peak"] = 100.0 * nbytes / (us * 1e-6) / HBM_PEAK
                if flops:
                    row["TFLOPs"] = flops / (us * 1e-6) / 1e12
            if torch_fn is not None:
                row["torch_us"] = _bench(torch_fn)
        except Exception as e:  # keep the table going
            row["ok"] = False
            row["error"] = f"{type(e).__name__}: {e}"
        if extra:
            row.update(extra)
        if not row["ok"]:
            self.failed = True
        self.rows.append(row)
        self._print_row(row)

    def error(self, name, exc):
        self.failed = True
        row = {"name": name, "ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        self.rows.append(row)
        print(f"{name:34s} ERROR {row['error']}", flush=True)
        traceback.print_exc()

    @staticmethod
    def _print_row(r):
        us = f"{r['us']:9.1f}" if "us" in r else " " * 9
        gbs = f"{r['GBps']:8.0f}" if "GBps" in r else " " * 8
        pct = f"{r['pct_hbm_peak']:5.1f}%" if "pct_hbm_peak" in r else " " * 6
        tus = f"{r['torch_us']:9.1f}" if "torch_us" in r else " " * 9
        extra = f" {r['TFLOPs']:.1f} TFLOP/s" if "TFLOPs" in r else ""
        chk = "ok  " if r["ok"] else "FAIL"
        cfg = f" cfg={r['config']}" if "config" in r else ""
        print(
            f"{r['name']:34s} {chk} {us} us {gbs} GB/s {pct}  torch {tus} us{extra} "
            f"{json.dumps(r['check'])}{cfg}" + (f" ERROR {r['error']}" if "error" in r else ""),
            flush=True,
        )


# ----------------------------------------------------------------------------------------------------


def bench_decode_attention(run: Runner, dev, gen):
    from ouro_backend.kernels import auto_num_splits, paged_attention, paged_attention_ref

    ctx = CTX
    batches = DECODE_BATCHES[:2] if run.args.quick else DECODE_BATCHES
    for B in batches:
        name = f"decode_attn B={B} ctx={ctx}"
        try:
            q, kc, vc, cu, sl, bt = _paged_batch([1] * B, [ctx] * B, dev, gen)
            scale = HD**-0.5
            out = paged_attention(q, kc, vc, cu, sl, bt, scale, 1)
            ref = paged_attention_ref(q, kc, vc, cu, sl, bt, scale, 1)
            err = rel_err(out, ref)
            nbytes = B * ctx * KVH * HD * 2 * 2 + 2 * q.numel() * 2 + bt.numel() * 4
            k_d, v_d = _gather_dense(kc, vc, bt, ctx, B)
            q_d = q.view(B, H, 1, HD)
            sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q_d, k_d, v_d)  # noqa: E731
            splits = auto_num_splits(B, KVH, 1, q.device)
            run.record(
                name,
                {"B": B, "ctx": ctx},
                lambda: paged_attention(q, kc, vc, cu, sl, bt, scale, 1, out=out),
                nbytes,
                {"rel_err": err},
                err < 2e-2,
                torch_fn=sdpa,
                extra={"num_splits": splits},
            )
            if splits != 1:
                out1 = paged_attention(q, kc, vc, cu, sl, bt, scale, 1, num_splits=1)
                err1 = rel_err(out1, ref)
                run.record(
                    name + " splits=1",
                    {"B": B, "ctx": ctx},
                    lambda: paged_attention(q, kc, vc, cu, sl, bt, scale, 1, out=out1, num_splits=1),
                    nbytes,
                    {"rel_err": err1},
                    err1 < 2e-2,
                )
            if run.args.sweep:
                _sweep_attention(run, name, q, kc, vc, cu, sl, bt, scale, 1, nbytes, decode=True)
            q = kc = vc = k_d = v_d = None  # the GPU memory goes before the next batch takes its own
        except Exception as e:
            run.error(name, e)


def bench_prefill_attention(run: Runner, dev, gen):
    from ouro_backend.kernels import paged_attention, paged_attention_ref

    R, n = PREFILL
    name = f"prefill_attn {R}x{n}"
    try:
        q, kc, vc, cu, sl, bt = _paged_batch([n] * R, [n] * R, dev, gen)
        scale = HD**-0.5
        out = paged_attention(q, kc, vc, cu, sl, bt, scale, n)
        ref = paged_attention_ref(q, kc, vc, cu, sl, bt, scale, n)
        err = rel_err(out, ref)
        nbytes = R * n * KVH * HD * 2 * 2 + 2 * q.numel() * 2
        flops = 4 * H * HD * R * n * (n + 1) / 2
        k_d, v_d = _gather_dense(kc, vc, bt, n, R)
        q_d = q.view(R, n, H, HD).transpose(1, 2).contiguous()
        sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q_d, k_d, v_d, is_causal=True)  # noqa
        run.record(
            name,
            {"rows": R, "tokens_per_row": n},
            lambda: paged_attention(q, kc, vc, cu, sl, bt, scale, n, out=out),
            nbytes,
            {"rel_err": err},
            err < 2e-2,
            torch_fn=sdpa,
            flops=flops,
        )
        if run.args.sweep:
            _sweep_attention(run, name, q, kc, vc, cu, sl, bt, scale, n, nbytes, decode=False, flops=flops)
        q = kc = vc = k_d = v_d = None  # the GPU memory goes before the next benchmark
    except Exception as e:
        run.error(name, e)
    # a mixed round: one 512-token prompt chunk (after 512 cached) + 63 decode rows at ctx 1152
    chunk, chunk_len, ndec = MIXED
    name = f"mixed_attn 1x{chunk}@{chunk_len} + {ndec} decode"
    try:
        ns = [chunk] + [1] * ndec
        sls = [chunk_len] + [CTX] * ndec
        q, kc, vc, cu, sl, bt = _paged_batch(ns, sls, dev, gen)
        scale = HD**-0.5
        out = paged_attention(q, kc, vc, cu, sl, bt, scale, chunk)
        ref = paged_attention_ref(q, kc, vc, cu, sl, bt, scale, chunk)
        err = rel_err(out, ref)
        nbytes = sum(sls) * KVH * HD * 2 * 2 + 2 * q.numel() * 2
        run.record(
            name,
            {"ns": f"{chunk}+{ndec}x1"},
            lambda: paged_attention(q, kc, vc, cu, sl, bt, scale, chunk, out=out),
            nbytes,
            {"rel_err": err},
            err < 2e-2,
        )
    except Exception as e:
        run.error(name, e)


def _sweep_attention(run, name, q, kc, vc, cu, sl, bt, scale, max_q, nbytes, decode, flops=None):
    from ouro_backend.kernels import paged_attention

    if decode:
        grid = [
            dict(block_n=bn, num_warps=w, num_stages=s, num_splits=sp)
            for bn in (32, 64, 128)
            for w in (2, 4, 8)
            for s in (2, 3, 4)
            for sp in (1, 2, 4, 8)
        ]
    else:
        grid = [
            dict(block_m=bm, block_n=bn, num_warps=w, num_stages=s)
            for bm in (64, 128)
            for bn in (32, 64, 128)
            for w in (4, 8)
            for s in (1, 2, 3)
        ]
    import random

    random.Random(0).shuffle(grid)  # a time-boxed sweep still samples the whole grid
    best = None
    t0 = time.time()
    for cfg in grid:
        if time.time() - t0 > run.args.sweep_seconds:
            break
        try:
            out = paged_attention(q, kc, vc, cu, sl, bt, scale, max_q, **cfg)
            us = _bench(lambda: paged_attention(q, kc, vc, cu, sl, bt, scale, max_q, out=out, **cfg))
        except Exception:
            continue
        if best is None or us < best[0]:
            best = (us, cfg)
    if best is not None:
        us, cfg = best
        row = {
            "name": name + " [sweep best]",
            "ok": True,
            "check": {},
            "us": us,
            "config": cfg,
            "bytes": int(nbytes),
            "GBps": nbytes / (us * 1e-6) / 1e9,
            "pct_hbm_peak": 100.0 * nbytes / (us * 1e-6) / HBM_PEAK,
        }
        if flops:
            row["TFLOPs"] = flops / (us * 1e-6) / 1e12
        run.rows.append(row)
        run._print_row(row)


def bench_norms(run: Runner, dev, gen):
    from ouro_backend.kernels import rms_norm, rms_norm_ref, sandwich_norm, sandwich_norm_ref

    for N in TOKENS:
        name = f"rms_norm N={N}"
        try:
            x = torch.randn(N, HIDDEN, device=dev, dtype=DT) * 3
            w = (1 + 0.2 * torch.randn(HIDDEN, device=dev)).to(DT)
            y = rms_norm(x, w, EPS)
            st = _ulp_stats(y, rms_norm_ref(x, w, EPS))
            run.record(
                name,
                {"N": N, "D": HIDDEN},
                lambda: rms_norm(x, w, EPS, out=y),
                2 * N * HIDDEN * 2 + HIDDEN * 2,
                st,
                _ulp_ok(st),
                torch_fn=lambda: rms_norm_ref(x, w, EPS),
            )
        except Exception as e:
            run.error(name, e)
        name = f"sandwich_norm N={N}"
        try:
            x = torch.randn(N, HIDDEN, device=dev, dtype=DT) * 2
            res = torch.randn(N, HIDDEN, device=dev, dtype=DT) * 5
            w1 = (1 + 0.2 * torch.randn(HIDDEN, device=dev)).to(DT)
            w2 = (1 + 0.2 * torch.randn(HIDDEN, device=dev)).to(DT)
            nr, y = sandwich_norm(x, res, w1, w2, EPS)
            nr_ref, y_ref = sandwich_norm_ref(x, res, w1, w2, EPS)
            st1, st2 = _ulp_stats(nr, nr_ref), _ulp_stats(y, y_ref)
            run.record(
                name,
                {"N": N, "D": HIDDEN},
                lambda: sandwich_norm(x, res, w1, w2, EPS, residual_out=nr, out=y),
                4 * N * HIDDEN * 2 + 2 * HIDDEN * 2,
                {"residual": st1, "y": st2},
                _ulp_ok(st1) and _ulp_ok(st2),
                torch_fn=lambda: sandwich_norm_ref(x, res, w1, w2, EPS),
            )
        except Exception as e:
            run.error(name, e)


def bench_rope_kv(run: Runner, dev, gen):
    from ouro_backend.kernels import (
        build_cos_sin_cache,
        rope_,
        rope_and_write_kv,
        rope_and_write_kv_ref,
        rope_ref,
        write_kv,
        write_kv_ref,
    )

    cache = build_cos_sin_cache(MAX_POS, HD, 1e6, device=dev)
    for N in TOKENS:
        qkv = torch.randn(N, (H + 2 * KVH) * HD, device=dev, dtype=DT)
        q = qkv[:, : H * HD].view(N, H, HD)
        k = qkv[:, H * HD : (H + KVH) * HD].view(N, KVH, HD)
        v = qkv[:, (H + KVH) * HD :].view(N, KVH, HD)
        positions = torch.randint(0, min(4096, MAX_POS), (N,), device=dev, dtype=torch.int64)
        nblocks = N // BS + 64
        slots = torch.randperm(nblocks * BS, device=dev)[:N].to(torch.int64)
        slots[::7] = -1
        kc = torch.zeros(nblocks, BS, KVH, HD, device=dev, dtype=DT)
        vc = torch.zeros_like(kc)

        name = f"rope N={N}"
        try:
            q1, k1 = q.clone(), k.clone()
            q2, k2 = q.clone(), k.clone()
            rope_(q1, k1, positions, cache)
            rope_ref(q2, k2, positions, cache)
            st = {"q": _ulp_stats(q1, q2), "k": _ulp_stats(k1, k2)}
            nbytes = 2 * N * (H + KVH) * HD * 2 + N * HD * 4 + N * 8
            run.record(
                name,
                {"N": N},
                lambda: rope_(q, k, positions, cache),
                nbytes,
                st,
                _ulp_ok(st["q"], 0, 1.0) and _ulp_ok(st["k"], 0, 1.0),
                torch_fn=lambda: rope_ref(q1, k1, positions, cache),
            )
        except Exception as e:
            run.error(name, e)

        name = f"write_kv N={N}"
        try:
            kc2, vc2 = kc.clone(), vc.clone()
            write_kv(k, v, kc, vc, slots)
            write_kv_ref(k, v, kc2, vc2, slots)
            ok = torch.equal(kc, kc2) and torch.equal(vc, vc2)
            nv = int((slots >= 0).sum().item())
            run.record(
                name,
                {"N": N},
                lambda: write_kv(k, v, kc, vc, slots),
                nv * KVH * HD * 2 * 2 * 2 + N * 8,
                {"equal": ok},
                ok,
                torch_fn=lambda: write_kv_ref(k, v, kc2, vc2, slots),
            )
        except Exception as e:
            run.error(name, e)

        name = f"rope_and_write_kv N={N}"
        try:
            q1, q2 = q.clone(), q.clone()
            kc1, vc1, kc2, vc2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
            rope_and_write_kv(q1, k, v, positions, cache, kc1, vc1, slots)
            rope_and_write_kv_ref(q2, k.clone(), v, positions, cache, kc2, vc2, slots)
            st = {"q": _ulp_stats(q1, q2), "k_cache": _ulp_stats(kc1, kc2), "v_equal": torch.equal(vc1, vc2)}
            nv = int((slots >= 0).sum().item())
            nbytes = 2 * N * H * HD * 2 + N * HD * 4 + N * 16 + nv * KVH * HD * 2 * 4  # q rw, k/v read+write
            run.record(
                name,
                {"N": N},
                lambda: rope_and_write_kv(q1, k, v, positions, cache, kc1, vc1, slots),
                nbytes,
                st,
                _ulp_ok(st["q"], 0, 1.0) and _ulp_ok(st["k_cache"], 0, 1.0) and st["v_equal"],
                torch_fn=lambda: rope_and_write_kv_ref(q2, k.clone(), v, positions, cache, kc2, vc2, slots),
            )
        except Exception as e:
            run.error(name, e)


def bench_silu_copy(run: Runner, dev, gen):
    from ouro_backend.kernels import copy_kv_slots, copy_kv_slots_ref, silu_mul, silu_mul_ref

    for N in TOKENS:
        name = f"silu_mul N={N} I={INTER}"
        try:
            gu = torch.randn(N, 2 * INTER, device=dev, dtype=DT) * 3
            y = silu_mul(gu)
            st = _ulp_stats(y, silu_mul_ref(gu))
            run.record(
                name,
                {"N": N, "I": INTER},
                lambda: silu_mul(gu, out=y),
                3 * N * INTER * 2,
                st,
                _ulp_ok(st, 2, 0.98),
                torch_fn=lambda: silu_mul_ref(gu),
            )
        except Exception as e:
            run.error(name, e)
    name = f"copy_kv_slots L={LAYERS} M=64"
    try:
        nb = 512
        kv = torch.randn(LAYERS, 2, nb, BS, KVH, HD, device=dev, dtype=DT)
        perm = torch.randperm(nb * BS, device=dev).to(torch.int64)
        src, dst = perm[:64].contiguous(), perm[64:128].contiguous()
        kv2 = kv.clone()
        copy_kv_slots(kv, src, dst)
        copy_kv_slots_ref(kv2, src, dst)
        ok = torch.equal(kv, kv2)
        run.record(
            name,
            {"L": LAYERS, "M": 64},
            lambda: copy_kv_slots(kv, src, dst),
            2 * 64 * LAYERS * 2 * KVH * HD * 2,
            {"equal": ok},
            ok,
            torch_fn=lambda: copy_kv_slots_ref(kv2, src, dst),
        )
    except Exception as e:
        run.error(name, e)


def check_cuda_graph(run: Runner, dev, gen):
    """Capture rope+KV write -> decode attention (split-K at B=4) -> sandwich norm; replay with new
    lengths/slots/positions written into the static inputs; compare with eager references."""

    for B in GRAPH_BATCHES:
        _check_cuda_graph(run, dev, gen, B)


def _check_cuda_graph(run: Runner, dev, gen, B):
    from ouro_backend.kernels import (
        auto_num_splits,
        build_cos_sin_cache,
        paged_attention,
        paged_attention_ref,
        rope_and_write_kv,
        rope_and_write_kv_ref,
        sandwich_norm,
        sandwich_norm_ref,
    )

    name = f"cuda_graph decode B={B}"
    try:
        ctx0 = 700
        q, kc, vc, cu, sl, bt = _paged_batch([1] * B, [ctx0 + 40] * B, dev, gen)  # room to grow
        sl.fill_(ctx0)
        cache = build_cos_sin_cache(4096, HD, 1e6, device=dev)
        qkv = torch.randn(B, (H + 2 * KVH) * HD, device=dev, dtype=DT)
        pos = (sl.long() - 1).clone()
        bt_l = bt.long()
        slots = bt_l[torch.arange(B, device=dev), pos // BS] * BS + pos % BS
        res = torch.randn(B, HIDDEN, device=dev, dtype=DT)
        w1 = (1 + 0.2 * torch.randn(HIDDEN, device=dev)).to(DT)
        w2 = (1 + 0.2 * torch.randn(HIDDEN, device=dev)).to(DT)
        attn_out = torch.empty(B, H, HD, device=dev, dtype=DT)
        y = torch.empty(B, HIDDEN, device=dev, dtype=DT)
        res_out = torch.empty_like(res)

        def step_on(qkv_, kc_, vc_, attn_, res_out_, y_):
            qv = qkv_[:, : H * HD].view(B, H, HD)
            kv_ = qkv_[:, H * HD : (H + KVH) * HD].view(B, KVH, HD)
            vv = qkv_[:, (H + KVH) * HD :].view(B, KVH, HD)
            rope_and_write_kv(qv, kv_, vv, pos, cache, kc_, vc_, slots)
            paged_attention(qv, kc_, vc_, cu, sl, bt, HD**-0.5, 1, out=attn_)
            sandwich_norm(attn_.view(B, HIDDEN), res, w1, w2, EPS, residual_out=res_out_, out=y_)

        def step():
            step_on(qkv, kc, vc, attn_out, res_out, y)

        def eager_ref(qkv0, kc0, vc0):
            qv = qkv0[:, : H * HD].view(B, H, HD).clone()
            kv_ = qkv0[:, H * HD : (H + KVH) * HD].view(B, KVH, HD)
            vv = qkv0[:, (H + KVH) * HD :].view(B, KVH, HD)
            rope_and_write_kv_ref(qv, kv_.clone(), vv, pos, cache, kc0, vc0, slots)
            a = paged_attention_ref(qv, kc0, vc0, cu, sl, bt, HD**-0.5, 1)
            return a, sandwich_norm_ref(a.view(B, HIDDEN), res, w1, w2, EPS)

        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm-up compiles every kernel outside the capture
            qkv_save, kc_save, vc_save = qkv.clone(), kc.clone(), vc.clone()
            step()
            qkv.copy_(qkv_save)
            kc.copy_(kc_save)
            vc.copy_(vc_save)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        errs, same = [], True
        for it in range(3):  # new lengths / positions / slots / activations each replay
            sl.add_(7 if it else 0)
            pos.copy_(sl.long() - 1)
            slots.copy_(bt_l[torch.arange(B, device=dev), pos // BS] * BS + pos % BS)
            qkv.copy_(torch.randn_like(qkv))
            qkv0, kc0, vc0 = qkv.clone(), kc.clone(), vc.clone()
            # eager run of the same kernels on copies: the replay must match it bit for bit
            qkv1, kc1, vc1 = qkv.clone(), kc.clone(), vc.clone()
            a1, r1, y1 = torch.empty_like(attn_out), torch.empty_like(res_out), torch.empty_like(y)
            step_on(qkv1, kc1, vc1, a1, r1, y1)
            g.replay()
            torch.cuda.synchronize()
            same = same and all(
                torch.equal(u, w)
                for u, w in ((attn_out, a1), (res_out, r1), (y, y1), (kc, kc1), (vc, vc1), (qkv, qkv1))
            )
            a_ref, (nr_ref, y_ref) = eager_ref(qkv0, kc0, vc0)
            errs.append(max(rel_err(attn_out, a_ref), rel_err(res_out, nr_ref), rel_err(y, y_ref)))
        err = max(errs)
        run.record(
            name,
            {"B": B, "num_splits": auto_num_splits(B, KVH, 1, q.device)},
            None,
            None,
            {"replay_equals_eager": same, "max_rel_err_vs_ref": err},
            same and err < 3e-2,
        )
    except Exception as e:
        run.error(name, e)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--quick", action="store_true", help="fewer cases (decode B=1/16 only)")
    ap.add_argument("--sweep", action="store_true", help="also sweep attention launch configs (minutes)")
    ap.add_argument("--sweep-seconds", type=float, default=40.0, help="time box per swept case")
    ap.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph capture check")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels needs a CUDA GPU (use tests/test_kernels.py on CPU)", file=sys.stderr)
        return 2
    import triton

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(dev)
    print(
        f"device: {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}; "
        f"triton {triton.__version__}; HBM peak assumed {HBM_PEAK / 1e12:.1f} TB/s",
        flush=True,
    )
    run = Runner(args)
    t0 = time.time()
    bench_decode_attention(run, dev, gen)
    bench_prefill_attention(run, dev, gen)
    bench_norms(run, dev, gen)
    bench_rope_kv(run, dev, gen)
    bench_silu_copy(run, dev, gen)
    if not args.no_graph:
        check_cuda_graph(run, dev, gen)
    summary = {
        "device": props.name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "hbm_peak_Bps": HBM_PEAK,
        "shapes": {"H": H, "KVH": KVH, "HD": HD, "hidden": HIDDEN, "inter": INTER, "block_size": BS, "dtype": str(DT)},
        "all_ok": not run.failed,
        "seconds": time.time() - t0,
        "results": run.rows,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1, default=str)
        print(f"wrote {args.out}")
    print("ALL CHECKS OK" if not run.failed else "SOME CHECKS FAILED", flush=True)
    return 0 if not run.failed else 1


if __name__ == "__main__":
    sys.exit(main())
