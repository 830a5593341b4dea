"""Decode attention (no RoPE: the path above 16 rows) launch configs at Ouro-1.4B shapes: every config of a
grid against the default, do_bench medians with L2 flushed, bytes over 4.8 TB/s."""
import json, sys, time
import torch
sys.path.insert(0, ".")
from benchmarks.kernels.bench_kernels import _bench, _paged_batch, KVH, HD, HBM_PEAK
from ouro_backend.kernels import paged_attention, paged_attention_ref

gen = torch.Generator().manual_seed(0)
dev = "cuda"
out_rows = []
cases = [(64, 256), (64, 1152), (128, 1152), (16, 256)]
grid = [dict(block_n=bn, num_warps=w, num_stages=s) for bn in (32, 64, 128) for w in (2, 4, 8) for s in (2, 3, 4)]
t_all = time.time()
for B, ctx in cases:
    q, kc, vc, cu, sl, bt = _paged_batch([1] * B, [ctx] * B, dev, gen)
    scale = HD**-0.5
    nbytes = B * ctx * KVH * HD * 2 * 2 + 2 * q.numel() * 2
    ref = paged_attention_ref(q, kc, vc, cu, sl, bt, scale, 1).float()
    splits_opts = (1, 2, 4) if B <= 16 else (1, 2)
    out = paged_attention(q, kc, vc, cu, sl, bt, scale, 1)
    base = _bench(lambda: paged_attention(q, kc, vc, cu, sl, bt, scale, 1, out=out))
    res = []
    t0 = time.time()
    for sp in splits_opts:
        for cfg in grid:
            if time.time() - t0 > 75:
                break
            c = dict(cfg, num_splits=sp)
            try:
                o = paged_attention(q, kc, vc, cu, sl, bt, scale, 1, **c)
                err = ((o.float() - ref).abs().max() / ref.abs().max()).item()
                us = _bench(lambda: paged_attention(q, kc, vc, cu, sl, bt, scale, 1, out=o, **c))
            except Exception as e:
                print(B, ctx, c, "ERR", type(e).__name__, str(e)[:100]); continue
            res.append((us, c, err))
    res.sort(key=lambda r: r[0])
    pct = lambda us: round(100 * nbytes / (us * 1e-6) / HBM_PEAK, 1)
    print(f"B={B} ctx={ctx} default {base:.1f} us ({pct(base)}%)  tried {len(res)}", flush=True)
    for us, c, err in res[:6]:
        print(f"   {us:.1f} us ({pct(us)}%) {c} err {err:.1e}", flush=True)
    out_rows.append(dict(B=B, ctx=ctx, bytes=nbytes, default_us=round(base, 2), default_pct=pct(base),
                         best=[dict(us=round(us, 2), pct=pct(us), config=c, rel_err=err) for us, c, err in res[:10]]))
    q = kc = vc = None
    torch.cuda.empty_cache()
json.dump(out_rows, open(sys.argv[1], "w"), indent=1)
print("elapsed", round(time.time() - t_all, 1))
