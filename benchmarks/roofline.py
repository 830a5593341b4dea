"""The decode roofline of the Ouro-1.4B shape (random bf16 weights): every op of a loop timed alone against
its bytes and FLOPs, the engine's captured decode rounds, and a 2,048-token prompt chunk.

    PYTHONPATH=$PWD python3 benchmarks/roofline.py --out roofline.json [--label after]
    OURO_PDL=0 OURO_LINEAR=cublas PYTHONPATH=$PWD python3 benchmarks/roofline.py --out roofline_before.json

The second line is the same code with the decode-projection kernel and programmatic dependent launch off
(cuBLAS projections and the SiLU-mul kernel, as before them).

- ``kernels``: each op of a decode loop at 1 and 64 rows, as the backend runs it, timed as a CUDA graph of
  the 24 layers' calls (distinct weights and KV planes, so weights stream from HBM), median of replays;
  ``bytes`` is what the op must move (weights, activations in and out, KV read at ``--context`` tokens),
  ``flops`` its arithmetic; ``pct_of_peak`` is the larger of bytes/s over ``--hbm-tb-s`` and FLOP/s over
  ``--bf16-tflops``. ``sum_us`` per row count vs ``decode_loop`` shows what the ops lose between them.
- ``decode_loop``: one decode round's graph (one loop for every row, gate, LM head, sampling) replayed
  alone, by rows (the engine's capture lengths); ``floor_loop_ms`` is the loop's weights alone over
  ``--hbm-tb-s`` (the LM head's bytes are ``lm_head_bytes``; KV reads are not counted).
- ``prompt_chunk_2048_ms``: a fresh 2,048-token prompt through the engine's steps (all four loops, max_tokens
  1) until its token is on the host (`benchmarks.prompt_work.fresh_prompt_ms`), median of 3, with its TFLOP/s.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

import torch

from benchmarks.graph_timing import graph_ms, replay_ms
from benchmarks.prompt_work import fresh_prompt_ms, prompt_flops
from ouro_backend import EngineConfig, LLMEngine
from ouro_backend.entrypoints.bench import ensure_shape_checkpoint
from ouro_backend.kernels import projections
from ouro_backend.model.sampler import SamplerMode


def op_rows(eng: LLMEngine, M: int, ctx: int, hbm: float, peak: float) -> list[dict]:
    """Each op of a decode loop at M rows over the model's 24 layers."""
    m = eng.runner.model
    cfg, ops = m.cfg, m.backend
    dev, dt = m.device, m.dtype
    H, I, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    nh, kvh, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    bs = 16
    blocks_per_row = (ctx + bs - 1) // bs
    nblocks = M * blocks_per_row
    caches = [torch.randn(2, nblocks, bs, kvh, hd, device=dev, dtype=dt) for _ in range(L)]
    tables = torch.arange(nblocks, device=dev, dtype=torch.int32).view(M, blocks_per_row)
    cu = torch.arange(M + 1, device=dev, dtype=torch.int32)
    lens = torch.full((M,), ctx, device=dev, dtype=torch.int32)
    pos = torch.full((M,), ctx - 1, device=dev, dtype=torch.int64)
    slots = tables[:, -1].to(torch.int64) * bs + (ctx - 1) % bs
    x = torch.randn(M, H, device=dev, dtype=dt)
    qkv = torch.randn(M, cfg.q_size + 2 * cfg.kv_size, device=dev, dtype=dt)
    attn = torch.randn(M, cfg.q_size, device=dev, dtype=dt)
    gu = torch.randn(M, 2 * I, device=dev, dtype=dt)
    e = 2  # bytes per element
    layers = m.layers

    def q_k_v():
        q = qkv[:, : cfg.q_size].view(M, nh, hd)
        k = qkv[:, cfg.q_size : cfg.q_size + cfg.kv_size].view(M, kvh, hd)
        v = qkv[:, cfg.q_size + cfg.kv_size :].view(M, kvh, hd)
        return q, k, v

    q, k, v = q_k_v()
    from ouro_backend.model.attention import AttentionMetadata

    meta = AttentionMetadata(cu, lens, tables, slots, 1, ctx, decode_rows=0)
    # the MLP as `backend.mlp` runs it: SiLU-mul in gate/up's epilogue, or (gate/up on cuBLAS) in down's x load
    glu = projections.glu_in_epilogue(layers[0].gate_up, M)
    act = torch.randn(M, I, device=dev, dtype=dt)
    inputs = {"qkv": x, "o": attn, "gate_up": x, "down": act if glu else gu}
    proj = lambda w: (  # noqa: E731
        (
            lambda: [
                ops.linear(inputs[w], getattr(ly, w), glu=glu and w == "gate_up", silu_x=not glu and w == "down")
                for ly in layers
            ]
        ),
        getattr(layers[0], w).numel() * e,
        2 * M * getattr(layers[0], w).numel(),
    )
    act_in = lambda n: M * n * e  # noqa: E731
    table = {
        "qkv_proj": proj("qkv"),
        "o_proj": proj("o"),
        "gate_up_proj (silu_mul in its epilogue when the kernel runs)": proj("gate_up"),
        "down_proj (silu_mul in its x load when gate_up is cuBLAS)": proj("down"),
        f"rope + KV write + attention (context {ctx})": (
            lambda: [ops.rope_kv_attention(q, k, v, pos, m.cos_sin, c[0], c[1], meta, m.scale) for c in caches],
            M * ctx * 2 * kvh * hd * e + act_in(cfg.q_size + 2 * cfg.kv_size) + act_in(cfg.q_size),
            4 * M * ctx * nh * hd,
        ),
        "sandwich_norm": (
            lambda: [ops.sandwich_norm(x, x, ly.ln_post, ly.ln_in, cfg.rms_norm_eps) for ly in layers],
            act_in(H) * 4,
            0,
        ),
        # once a round, not a loop; timed 24 times over (201 MB: from HBM, not L2) like the others
        "lm_head": (lambda: [m.logits(x) for _ in layers], m.lm_head.numel() * e, 2 * M * m.lm_head.numel()),
    }
    per_loop = {"sandwich_norm": 2, "lm_head": 0}
    rows = []
    for name, (fn, nbytes, flops) in table.items():
        t_us = graph_ms(fn) * 1e3 / L
        pct = max(nbytes / (t_us * 1e-6) / (hbm * 1e12), flops / (t_us * 1e-6) / (peak * 1e12))
        rows.append(
            dict(
                name=f"{name} M={M}",
                rows=M,
                time_us=round(t_us, 2),
                bytes=nbytes,
                flops=flops,
                pct_of_peak=round(100 * pct, 1),
                per_loop=per_loop.get(name, 1),
            )
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--label", default="")
    ap.add_argument("--hbm-tb-s", type=float, default=4.8)
    ap.add_argument("--bf16-tflops", type=float, default=990.0)
    ap.add_argument("--context", type=int, default=256)
    args = ap.parse_args()
    t0 = time.time()
    eng = LLMEngine(EngineConfig.from_strings({"model": ensure_shape_checkpoint("ouro-1.4b")}))
    r, m = eng.runner, eng.runner.model
    cfg = m.cfg
    loop_bytes = sum(t.numel() * t.element_size() for layer in m.layers for t in vars(layer).values())
    head_bytes = m.lm_head.numel() * m.lm_head.element_size()
    rep: dict = dict(
        label=args.label,
        env={k: os.environ.get(k) for k in ("OURO_PDL", "OURO_LINEAR", "OURO_GLU", "OURO_FUSED_CODA", "OURO_L2_AHEAD")},
        device=torch.cuda.get_device_name(),
        hbm_tb_s=args.hbm_tb_s,
        bf16_tflops=args.bf16_tflops,
        loop_weight_bytes=loop_bytes,
        lm_head_bytes=head_bytes,
        floor_loop_ms=round(loop_bytes / args.hbm_tb_s / 1e9, 4),
    )
    ones = {b: g for (b, rounds, mode), g in r.graphs.decode.items() if rounds == 1 and mode == SamplerMode.GREEDY}
    rep["decode_loop"] = {str(b): round(replay_ms(ones[b].graph, 50), 4) for b in sorted(ones)}
    print("decode_loop ms by rows", rep["decode_loop"], flush=True)
    kernels, sums = [], {}
    for M in (1, 64):
        rows = op_rows(eng, M, args.context, args.hbm_tb_s, args.bf16_tflops)
        kernels += rows
        sums[str(M)] = round(sum(x["time_us"] * x["per_loop"] * cfg.num_hidden_layers for x in rows) / 1e3, 4)
        for x in rows:
            print(f"  {x['name']:58s} {x['time_us']:8.2f} us  {x['pct_of_peak']:5.1f}% of peak", flush=True)
    rep["kernels"] = kernels
    rep["ops_sum_loop_ms"] = sums
    # a fresh 2,048-token prompt, all four loops, one chunk (max_num_batched_tokens)
    rng = random.Random(time.time_ns())
    times = [fresh_prompt_ms(eng, 2048, rng, f"p{i}") for i in range(4)]
    ms = statistics.median(times[1:])  # the first compiles and sizes the eager path
    flops = sum(prompt_flops(eng, 2048))
    rep["prompt_chunk_2048_ms"] = round(ms, 3)
    rep["prompt_chunk_2048_tflops"] = round(flops / (ms * 1e-3) / 1e12, 1)
    rep["prompt_chunk_2048_pct_of_peak"] = round(100 * flops / (ms * 1e-3) / (args.bf16_tflops * 1e12), 1)
    rep["elapsed_s"] = round(time.time() - t0, 1)
    print(json.dumps({k: v for k, v in rep.items() if k != "kernels"}, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rep, f, indent=1)


if __name__ == "__main__":
    main()
