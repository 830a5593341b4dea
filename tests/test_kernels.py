"""Triton kernels vs their torch references (ouro_backend.kernels).

Without a GPU the kernels run in Triton's CPU interpreter. Triton decides "interpreted or compiled" when a
@triton.jit decorator runs (it reads TRITON_INTERPRET then), so this module imports its own interpreted
copy of ``ouro_backend.kernels`` with TRITON_INTERPRET=1 set just for that import (and for these tests,
through a fixture), then restores the environment and ``sys.modules``: other test modules keep the normal
import, whose kernels fall back to the torch references on CPU instead of crawling through the
interpreter. Shapes are tiny; the whole file runs in well under a minute on 2 cores.
"""

import importlib
import json
import os
import subprocess
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
DEV = "cuda" if HAS_CUDA else "cpu"


def _import_interpreted_kernels():
    prefix = "ouro_backend.kernels"
    pkg = importlib.import_module("ouro_backend")  # first: its __init__ may import the kernels normally
    saved = {k: v for k, v in sys.modules.items() if k == prefix or k.startswith(prefix + ".")}
    had_attr = hasattr(pkg, "kernels")
    saved_attr = getattr(pkg, "kernels", None)
    saved_env = os.environ.get("TRITON_INTERPRET")
    for k in saved:
        del sys.modules[k]
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        mod = importlib.import_module(prefix)
    finally:
        if saved_env is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved_env
        for k in [k for k in sys.modules if k == prefix or k.startswith(prefix + ".")]:
            del sys.modules[k]
        sys.modules.update(saved)
        if had_attr:
            pkg.kernels = saved_attr
        elif hasattr(pkg, "kernels"):
            delattr(pkg, "kernels")
    return mod


if HAS_CUDA:
    import ouro_backend.kernels as K
else:
    K = _import_interpreted_kernels()

from ouro_backend.kernels._common import kernel_is_interpreted  # noqa: E402  (class check only)


@pytest.fixture(autouse=True, scope="module")
def _interpret_env():
    if HAS_CUDA:
        yield
        return
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    yield
    if old is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = old


DTYPES = [torch.float32, torch.bfloat16]


def _ulp_diff(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in ulps of a's 16-bit dtype (bf16 or fp16; same-sign finite values)."""
    dt = a.dtype if a.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    ai = a.to(dt).view(torch.int16).to(torch.int32)
    bi = b.to(dt).view(torch.int16).to(torch.int32)
    return (ai - bi).abs()


def _assert_bitwise_or_1ulp(got: torch.Tensor, ref: torch.Tensor, min_exact=0.98):
    assert torch.isfinite(got).all(), "output has NaN/inf (not fully written?)"
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
        return
    ulps = _ulp_diff(got, ref)
    assert ulps.max().item() <= 1, f"max ulp diff {ulps.max().item()}"
    exact = (ulps == 0).float().mean().item()
    assert exact >= min_exact, f"only {exact:.3f} bitwise equal"


def test_kernels_really_run_triton():
    """Guards against comparing the torch fallback with itself."""
    if HAS_CUDA:
        return
    for fn in (
        K.paged_attention,
        K.rope_kv_attention,
        K.write_kv,
        K.copy_kv_slots,
        K.rms_norm,
        K.sandwich_norm,
        K.rope_,
        K.rope_and_write_kv,
        K.silu_mul,
        K.linear,
        K.decode_step.prepare,
        K.decode_step.advance,
        K.coda.greedy_coda,
    ):
        kernels = [v for k, v in fn.__globals__.items() if k.startswith("_") and k.endswith("_kernel")]
        assert kernels and all(kernel_is_interpreted(k) for k in kernels), fn.__name__


# ---------------------------------------------------------------------------------------------------
# paged KV helpers
# ---------------------------------------------------------------------------------------------------


def _block_tables(rows_blocks, num_blocks, max_blocks, gen):
    """Random, non-contiguous, disjoint physical blocks per row; unused entries -> 0."""
    perm = torch.randperm(num_blocks, generator=gen)
    bt = torch.zeros(len(rows_blocks), max_blocks, dtype=torch.int32)
    c = 0
    for r, nb in enumerate(rows_blocks):
        bt[r, :nb] = perm[c : c + nb].to(torch.int32)
        c += nb
    return bt


def _slots(bt, r, positions, bs):
    return torch.tensor([int(bt[r, p // bs]) * bs + p % bs for p in positions], dtype=torch.int64)


def _make_batch(ns, seq_lens, H, kvh, hd, bs, dtype, gen, extra_blocks=3):
    """NaN-poisoned caches with every position < seq_len written (through the torch reference), a q that
    is a strided view into a fused qkv buffer, cu_seqlens, seq_lens and block tables."""
    R = len(ns)
    rows_blocks = [-(-L // bs) for L in seq_lens]
    nb = sum(rows_blocks) + extra_blocks
    max_blocks = max(rows_blocks) + 1
    bt = _block_tables(rows_blocks, nb, max_blocks, gen)
    kc = torch.full((nb, bs, kvh, hd), float("nan"), dtype=dtype)
    vc = torch.full((nb, bs, kvh, hd), float("nan"), dtype=dtype)
    for r in range(R):
        L = seq_lens[r]
        if L == 0:
            continue
        s = _slots(bt, r, range(L), bs)
        K.write_kv_ref(
            torch.randn(L, kvh, hd, generator=gen).to(dtype),
            torch.randn(L, kvh, hd, generator=gen).to(dtype),
            kc,
            vc,
            s,
        )
    N = sum(ns)
    qkv = torch.randn(N, (H + 2 * kvh) * hd, generator=gen).to(dtype)
    q = qkv[:, : H * hd].view(N, H, hd)  # token stride (H + 2 kvh) * hd
    cu = torch.zeros(R + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(ns), 0).to(torch.int32)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    return (q.to(DEV), kc.to(DEV), vc.to(DEV), cu.to(DEV), sl.to(DEV), bt.to(DEV))


# ---------------------------------------------------------------------------------------------------
# paged attention
# ---------------------------------------------------------------------------------------------------

ATTN_CASES = [
    # (H, kvh, hd, dtype, num_splits, block_m, block_n)
    (4, 2, 16, torch.float32, 1, None, None),
    (4, 2, 16, torch.float32, 3, 16, 16),  # split-K over a varlen batch
    (4, 1, 32, torch.float32, 1, 16, 16),  # G = 4 -> BLOCK_Q = 4: several q tiles per row
    (6, 2, 24, torch.float32, 2, None, 16),  # G = 3 (padded to 4), head_dim 24 (padded to 32)
    (2, 2, 16, torch.float32, 1, 16, 16),  # MHA
    (4, 2, 16, torch.bfloat16, 1, None, 16),
    (4, 1, 32, torch.bfloat16, 3, 16, 16),
]


@pytest.mark.parametrize("H,kvh,hd,dtype,splits,block_m,block_n", ATTN_CASES)
def test_paged_attention_varlen(H, kvh, hd, dtype, splits, block_m, block_n):
    gen = torch.Generator().manual_seed(1000 + H * 31 + kvh * 7 + hd + splits)
    bs = 4
    # rows: decode with context, fresh 3-token prompt, 7-token chunk after a 5-token prefix, empty row
    ns = [1, 3, 7, 0]
    seq_lens = [9, 3, 12, 5]
    q, kc, vc, cu, sl, bt = _make_batch(ns, seq_lens, H, kvh, hd, bs, dtype, gen)
    out = torch.full(q.shape, float("nan"), dtype=dtype, device=DEV)
    max_q = 9  # > the real max (7): padding as under a captured CUDA graph
    res = K.paged_attention(
        q, kc, vc, cu, sl, bt, hd**-0.5, max_q, out=out, num_splits=splits, block_m=block_m, block_n=block_n
    )
    assert res.data_ptr() == out.data_ptr()
    ref = K.paged_attention_ref(q, kc, vc, cu, sl, bt, hd**-0.5, max_q)
    assert torch.isfinite(out).all(), "NaN in output: unwritten rows or a read of an unwritten KV slot"
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=2e-5)
    else:
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


PACKED_CASES = [  # (query tokens a row, seq_lens, q tokens past the rows')
    ([5, 0, 9, 1, 4, 0, 13, 3, 0], [5, 2, 15, 7, 4, 0, 20, 3, 0], 6),
    ([8, 5], [8, 11], 0),  # the grid's last tile holds queries: the last row's second
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ns,seq_lens,extra", PACKED_CASES)
def test_paged_attention_packed_tiles_find_their_rows(dtype, ns, seq_lens, extra):
    """A prompt launch packs its rows' q tiles (row r's first at cu_q[r] // BLOCK_Q + r): rows whose starts fall
    mid-tile, empty rows between and at the end, one-token rows, rows of exactly one and of several tiles, a
    q buffer longer than the rows use (a mixed graph's token bucket) and a grid whose last tile is not empty,
    against the reference."""
    gen = torch.Generator().manual_seed(4242 + extra)
    H, kvh, hd, bs = 4, 1, 32, 4  # G = 4 -> BLOCK_Q = 4 at block_m 16
    q, kc, vc, cu, sl, bt = _make_batch(ns, seq_lens, H, kvh, hd, bs, dtype, gen)
    pad = torch.randn(extra, H, hd, generator=gen).to(dtype).to(DEV)
    qp = torch.cat([q, pad])  # tokens past cu[-1]: more packed tiles than the rows hold
    out = torch.full(qp.shape, float("nan"), dtype=dtype, device=DEV)
    K.paged_attention(qp, kc, vc, cu, sl, bt, hd**-0.5, 16, out=out, num_splits=1, block_m=16, block_n=16)
    ref = K.paged_attention_ref(q, kc, vc, cu, sl, bt, hd**-0.5, 16)
    got = out[: q.shape[0]]
    assert torch.isfinite(got).all(), "a query token no packed tile wrote"
    assert torch.isnan(out[q.shape[0] :]).all(), "a packed tile wrote past the rows' tokens"
    tol = dict(rtol=1e-5, atol=2e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.float(), ref.float(), **tol)


@pytest.mark.parametrize("splits", [1, 2, 5])
def test_paged_attention_decode(splits):
    gen = torch.Generator().manual_seed(7 + splits)
    H, kvh, hd, bs = 4, 2, 16, 4
    ns = [1, 1, 1]
    seq_lens = [1, 37, 20]  # one KV position only; several BLOCK_N=16 tiles; splits beyond the context
    q, kc, vc, cu, sl, bt = _make_batch(ns, seq_lens, H, kvh, hd, bs, torch.float32, gen)
    ref = K.paged_attention_ref(q, kc, vc, cu, sl, bt, 0.3, 1)
    out = K.paged_attention(q, kc, vc, cu, sl, bt, 0.3, 1, num_splits=splits, block_n=16)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=2e-5)


def test_paged_attention_splits_past_the_context_write_nothing(monkeypatch):
    """Splits with no keys exit before their partials and do not arrive; the merge reads only the used splits'
    partials. The partial buffers start as NaN, so a merge that read an unused one would poison the output, and
    one that waited for all splits would never write it. Rows of 1, 9 and 37 keys over 8 splits of 4-key grains,
    a pad row (seq_len 0), in fp32 and bf16."""
    gen = torch.Generator().manual_seed(23)
    H, kvh, hd, bs = 4, 2, 16, 4
    for dtype in (torch.float32, torch.bfloat16):
        q, kc, vc, cu, sl, bt = _make_batch([1, 1, 1, 1], [1, 9, 37, 5], H, kvh, hd, bs, dtype, gen)
        sl[3] = 0
        ref = K.paged_attention_ref(q, kc, vc, cu, sl, bt, 0.3, 1)
        empty = torch.empty

        def poisoned(*shape, **kw):
            t = empty(*shape, **kw)
            return t.fill_(float("nan")) if t.is_floating_point() else t

        monkeypatch.setattr(torch, "empty", poisoned)
        out = K.paged_attention(q, kc, vc, cu, sl, bt, 0.3, 1, num_splits=8, block_n=16, split_grain=4)
        monkeypatch.setattr(torch, "empty", empty)
        assert torch.isfinite(out).all() and (out[3] == 0).all()
        tol = dict(rtol=1e-5, atol=2e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(out.float(), ref.float(), **tol)


@pytest.mark.parametrize("splits", [1, 3])
def test_paged_attention_pad_row_zero_len(splits):
    """A CUDA-graph pad row (one query, seq_len 0, garbage block table) reads nothing and yields zeros."""
    gen = torch.Generator().manual_seed(17)
    H, kvh, hd, bs = 4, 2, 16, 4
    q, kc, vc, cu, sl, bt = _make_batch([1, 1, 2], [6, 1, 5], H, kvh, hd, bs, torch.float32, gen)
    sl[1] = 0
    bt[1] = 10**6  # never dereferenced
    out = K.paged_attention(q, kc, vc, cu, sl, bt, 0.25, 2, num_splits=splits, block_n=16)
    assert torch.isfinite(out).all()
    assert (out[1] == 0).all()
    bt[1] = 0
    ref = K.paged_attention_ref(q, kc, vc, cu, sl, bt, 0.25, 2)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=2e-5)


def test_paged_attention_matches_dense_causal_sdpa():
    """The reference itself against torch SDPA on a contiguous cache (one prompt row, GQA)."""
    gen = torch.Generator().manual_seed(3)
    H, kvh, hd, bs, L = 4, 2, 16, 4, 10
    q, kc, vc, cu, sl, bt = _make_batch([L], [L], H, kvh, hd, bs, torch.float32, gen)
    pos = torch.arange(L)
    blocks = bt[0].long().cpu()[pos // bs]
    k = kc.cpu()[blocks, pos % bs].repeat_interleave(H // kvh, 1)
    v = vc.cpu()[blocks, pos % bs].repeat_interleave(H // kvh, 1)
    dense = torch.nn.functional.scaled_dot_product_attention(
        q.cpu().transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
    ).transpose(0, 1)
    out = K.paged_attention(q, kc, vc, cu, sl, bt, hd**-0.5, L)
    torch.testing.assert_close(out.cpu(), dense, rtol=1e-5, atol=2e-5)


def _decode_positions_and_slots(seq_lens, bt, bs):
    """Decode rows' positions (the last of each row's seq_len) and their KV slots (-1: a pad row)."""
    positions = torch.tensor([max(L - 1, 0) for L in seq_lens], dtype=torch.int64, device=DEV)
    slots = torch.tensor(
        [int(bt[r, (L - 1) // bs]) * bs + (L - 1) % bs if L else -1 for r, L in enumerate(seq_lens)],
        dtype=torch.int64,
        device=DEV,
    )
    return positions, slots


@pytest.mark.parametrize(
    "H,kvh,dtype,splits,block_n,grain",
    [
        (4, 2, torch.float32, 1, None, None),
        (4, 2, torch.float32, 3, 16, None),
        (2, 2, torch.bfloat16, 2, None, None),
        (4, 1, torch.bfloat16, 5, 32, None),
        (4, 1, torch.bfloat16, 3, 32, 4),  # splits of whole blocks, partial tiles
    ],
)
def test_rope_kv_attention_equals_rope_then_attention(H, kvh, dtype, splits, block_n, grain):
    """The decode fusion writes bitwise the caches `rope_and_write_kv` writes, leaves q as it was, and gives
    `paged_attention`'s output up to the order of the softmax sums (it adds the new position after the
    tiles); a pad row (slot -1, seq_len 0) writes nothing and yields zeros. The new position starts as NaN in
    the cache: read from there, it would poison the output. ``block_n``: keys a tile, ``grain``: a split's
    keys a multiple of it (None: the defaults)."""
    gen = torch.Generator().manual_seed(97 + H + kvh + splits)
    hd, bs = 16, 4
    seq_lens = [9, 1, 20, 0]  # rows: context 8, a first token, context 19 (5 blocks), a pad row
    q, kc, vc, cu, sl, bt = _make_batch([1, 1, 1, 1], seq_lens, H, kvh, hd, bs, dtype, gen)
    positions, slots = _decode_positions_and_slots(seq_lens, bt, bs)
    kc.view(-1, kvh, hd)[slots[:3]] = float("nan")  # the new positions: not written yet
    vc.view(-1, kvh, hd)[slots[:3]] = float("nan")
    k = torch.randn(4, kvh, hd, generator=gen).to(dtype).to(DEV)
    v = torch.randn(4, kvh, hd, generator=gen).to(dtype).to(DEV)
    cache = K.build_cos_sin_cache(64, hd, 10000.0, device=DEV)
    q0 = q.clone()
    kc2, vc2 = kc.clone(), vc.clone()
    got = K.rope_kv_attention(
        q, k, v, positions, cache, kc, vc, slots, cu, sl, bt, 0.3, num_splits=splits, block_n=block_n,
        split_grain=grain,
    )  # fmt: skip
    assert torch.equal(q, q0), "q must not be rotated in place"
    q2 = q.clone()
    K.rope_and_write_kv(q2, k, v, positions, cache, kc2, vc2, slots)
    want = K.paged_attention(q2, kc2, vc2, cu, sl, bt, 0.3, 1, num_splits=splits)
    assert torch.isfinite(got).all() and (got[3] == 0).all()
    assert torch.equal(kc.nan_to_num(7.0), kc2.nan_to_num(7.0)) and torch.equal(vc.nan_to_num(7.0), vc2.nan_to_num(7.0))
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:  # bf16: P is rounded to bf16 against a different running max
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=1e-2)
    ref = K.rope_kv_attention_ref(q, k, v, positions, cache, kc2.clone(), vc2.clone(), slots, cu, sl, bt, 0.3)
    tol = dict(rtol=1e-5, atol=2e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.float(), ref.float(), **tol)


def test_decode_split_eight_ways_takes_multiples_of_32_keys():
    """`_attn_config`: a 16-bit decode whose KV is split 8 or more ways (one row of 16 kv heads on 132 SMs)
    gives each split a multiple of 32 keys, in tiles of 64, so that every split has keys at short contexts;
    fewer splits, fp32 and prefill split at whole tiles; explicit values win."""
    from ouro_backend.kernels.attention import _attn_config

    def tile_and_grain(max_q, fp32, splits, block_n=None, grain=None):
        cfg = _attn_config(max_q, 1, 128, fp32, None, block_n, None, None, splits, grain, rows=1)
        return cfg.block_n, cfg.split_grain

    assert tile_and_grain(1, False, 8) == tile_and_grain(1, False, 16) == (64, 32)
    assert tile_and_grain(1, False, 4) == tile_and_grain(1, True, 8) == tile_and_grain(64, False, 8) == (64, 64)
    assert tile_and_grain(1, False, 8, block_n=32) == (32, 32)
    assert tile_and_grain(1, False, 8, grain=64) == (64, 64)


def test_decode_launch_rules_by_rows():
    """A 16-bit decode's first tile is one 32-key grain where the splits take grains below a tile (else a
    tile); 3 stages up to 4 rows, 2 from 5; 4 warps up to 16 rows, 2 from 17; fp32 keeps its defaults; a 16-bit
    prompt chunk takes 64-row tiles, 3 stages and 4 warps, speculation's few verify queries 2 stages, and a launch
    of several q tiles without splits the packed grid.
    `splits_for` on 132 SMs at 16 kv heads: 8 / 4 / 4 / 4 / 2 splits at 1 / 2 / 3 / 4 / 5-8 rows, none from 9."""
    from ouro_backend.kernels.attention import _attn_config, splits_for

    def cfg(rows, splits=1, fp32=False, max_q=1, **kw):
        c = _attn_config(max_q, 1, 128, fp32, None, kw.get("block_n"), None, None, splits, kw.get("grain"), rows=rows)
        return c.first_n, c.num_stages, c.num_warps

    assert cfg(1, 8) == (32, 3, 4)
    assert cfg(4, 4) == (64, 3, 4) and cfg(5, 2) == cfg(16) == (64, 2, 4) and cfg(17) == cfg(64) == (64, 2, 2)
    assert cfg(1, 8, grain=16) == (16, 3, 4) and cfg(1, 8, block_n=32) == (32, 3, 4)
    assert cfg(64, fp32=True) == (64, 2, 8) and cfg(64, max_q=512)[1:] == (3, 4) and cfg(8, max_q=5)[1:] == (2, 4)
    assert _attn_config(512, 1, 128, False, None, None, None, None, rows=4).block_m == 64
    # a prompt chunk's launch (several q tiles, no splits) packs its tiles; decode and one q tile keep their grid
    prompt = _attn_config(512, 1, 128, False, None, None, None, None, rows=4)
    assert prompt.packed_tiles(512, 1) and not prompt.packed_tiles(64, 1) and not prompt.packed_tiles(512, 2)
    assert not _attn_config(1, 1, 128, False, None, None, None, None, 8, rows=1).packed_tiles(1, 8)
    assert [splits_for(rows * 16, 132) for rows in range(1, 10)] == [8, 4, 4, 4, 2, 2, 2, 2, 1]


@pytest.mark.parametrize(
    "dtype,splits", [(torch.float32, 1), (torch.bfloat16, 1), (torch.bfloat16, 4), (torch.bfloat16, 8)]
)
def test_rope_kv_attention_prefetch_kv_is_bitwise_the_same(dtype, splits):
    """``prefetch_kv`` (the metadata, the rotation and each split's first tile read before the PDL wait, the
    rest of the tiles in the loop) gives bitwise the output and caches of the plain path: rows of 3 tiles
    (one split), of one tile, a first token, a pad row, and (4 splits) splits with no keys at all; 8 splits
    take 32 keys each of the 150-key row in one 32-key first tile (`_attn_config`'s ``first_n``), and 96 of the
    600-key row: that first tile, then one of 64 keys."""
    gen = torch.Generator().manual_seed(131 + splits)
    H, kvh, hd, bs = 4, 2, 16, 4
    seq_lens = [150, 9, 1, 0, 600]
    q, kc, vc, cu, sl, bt = _make_batch([1] * 5, seq_lens, H, kvh, hd, bs, dtype, gen)
    positions, slots = _decode_positions_and_slots(seq_lens, bt, bs)
    k = torch.randn(5, kvh, hd, generator=gen).to(dtype).to(DEV)
    v = torch.randn(5, kvh, hd, generator=gen).to(dtype).to(DEV)
    cache = K.build_cos_sin_cache(1024, hd, 10000.0, device=DEV)
    caches = [(kc.clone(), vc.clone()) for _ in range(2)]
    outs = []
    for prefetch, (kcx, vcx) in zip((False, True), caches):
        if HAS_CUDA:  # NOTE prefetch_kv's promise: the kernel before it writes nothing it reads early
            torch.cuda.synchronize()
        outs.append(
            K.rope_kv_attention(
                q, k, v, positions, cache, kcx, vcx, slots, cu, sl, bt, 0.3, num_splits=splits, prefetch_kv=prefetch
            )
        )
    assert torch.isfinite(outs[0]).all() and (outs[0][3] == 0).all()
    assert torch.equal(outs[0], outs[1])
    for a, b in zip(caches[0], caches[1]):  # (unused slots hold NaN)
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
    ref = K.rope_kv_attention_ref(q, k, v, positions, cache, kc.clone(), vc.clone(), slots, cu, sl, bt, 0.3)
    tol = dict(rtol=1e-5, atol=2e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(outs[0].float(), ref.float(), **tol)


# ---------------------------------------------------------------------------------------------------
# KV writes and copies
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv(dtype):
    gen = torch.Generator().manual_seed(11)
    N, H, kvh, hd, bs, nb = 5, 4, 2, 16, 4, 6
    qkv = torch.randn(N, (H + 2 * kvh) * hd, generator=gen).to(dtype).to(DEV)
    k = qkv[:, H * hd : (H + kvh) * hd].view(N, kvh, hd)  # strided views into a fused qkv output
    v = qkv[:, (H + kvh) * hd :].view(N, kvh, hd)
    slots = torch.tensor([13, 2, -1, 22, 7], dtype=torch.int64, device=DEV)
    kc = torch.full((nb, bs, kvh, hd), float("nan"), dtype=dtype, device=DEV)
    vc = kc.clone()
    kc_ref, vc_ref = kc.clone(), vc.clone()
    K.write_kv(k, v, kc, vc, slots)
    K.write_kv_ref(k, v, kc_ref, vc_ref, slots)
    assert torch.equal(kc.isnan(), kc_ref.isnan()) and torch.equal(vc.isnan(), vc_ref.isnan())
    assert torch.equal(kc.nan_to_num(), kc_ref.nan_to_num()) and torch.equal(vc.nan_to_num(), vc_ref.nan_to_num())
    assert (~kc.isnan()).sum().item() == 4 * kvh * hd  # 4 real tokens; the pad row wrote nothing
    assert torch.equal(kc[22 // bs, 22 % bs], k[3])


def test_copy_kv_slots():
    gen = torch.Generator().manual_seed(5)
    L, nb, bs, kvh, hd = 3, 5, 4, 2, 16
    kv = torch.randn(L, 2, nb, bs, kvh, hd, generator=gen).to(DEV)
    src = torch.tensor([1, 6, -1, 17], dtype=torch.int64, device=DEV)
    dst = torch.tensor([9, 10, 3, 19], dtype=torch.int64, device=DEV)
    ref = kv.clone()
    K.copy_kv_slots_ref(ref, src, dst)
    before = kv.clone()
    K.copy_kv_slots(kv, src, dst)
    assert torch.equal(kv, ref)
    assert torch.equal(kv[:, :, 10 // bs, 10 % bs], before[:, :, 6 // bs, 6 % bs])
    assert torch.equal(kv[:, :, 3 // bs, 3 % bs], before[:, :, 3 // bs, 3 % bs])  # -1 pair skipped
    assert (kv != before).any()


# ---------------------------------------------------------------------------------------------------
# norms
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES + [torch.float16])
def test_rms_norm(dtype):
    gen = torch.Generator().manual_seed(21)
    N, D, eps = 33, 48, 1e-6  # D not a power of two
    big = (torch.randn(N, D + 16, generator=gen) * 3).to(dtype).to(DEV)
    x = big[:, :D]  # row stride D + 16
    w = (1 + 0.3 * torch.randn(D, generator=gen)).to(dtype).to(DEV)
    out = torch.full((N, D), float("nan"), dtype=dtype, device=DEV)
    y = K.rms_norm(x, w, eps, out=out)
    assert y.data_ptr() == out.data_ptr()
    _assert_bitwise_or_1ulp(y, K.rms_norm_ref(x, w, eps))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inplace", [False, True])
def test_sandwich_norm(dtype, inplace):
    gen = torch.Generator().manual_seed(22)
    N, D, eps = 17, 40, 1e-6
    x = (torch.randn(N, D, generator=gen) * 2).to(dtype).to(DEV)
    res = (torch.randn(N, D, generator=gen) * 5).to(dtype).to(DEV)
    w1 = (1 + 0.3 * torch.randn(D, generator=gen)).to(dtype).to(DEV)
    w2 = (1 + 0.3 * torch.randn(D, generator=gen)).to(dtype).to(DEV)
    nr_ref, y_ref = K.sandwich_norm_ref(x, res, w1, w2, eps)
    res_in = res.clone()
    out = torch.full((N, D), float("nan"), dtype=dtype, device=DEV)
    if inplace:
        nr, y = K.sandwich_norm(x, res_in, w1, w2, eps, residual_out=res_in, out=out)
        assert nr.data_ptr() == res_in.data_ptr()
    else:
        nr, y = K.sandwich_norm(x, res_in, w1, w2, eps, out=out)
        assert torch.equal(res_in, res)
    _assert_bitwise_or_1ulp(nr, nr_ref)
    _assert_bitwise_or_1ulp(y, y_ref)


# ---------------------------------------------------------------------------------------------------
# RoPE
# ---------------------------------------------------------------------------------------------------


def _hf_rope(x, positions, hd, theta):
    """HF apply_rotary_pos_emb, written out independently of the module under test."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    freqs = (inv_freq[None, :, None] @ positions.float()[None, None, :]).transpose(1, 2)[0]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(x.dtype)[:, None, :], emb.sin().to(x.dtype)[:, None, :]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope(dtype):
    gen = torch.Generator().manual_seed(31)
    N, H, kvh, hd, theta, max_pos = 6, 4, 2, 32, 1e6, 4000
    cache = K.build_cos_sin_cache(max_pos, hd, theta, device=DEV)
    positions = torch.tensor([0, 1, 7, 3999, 1234, 5], dtype=torch.int64, device=DEV)
    qkv = torch.randn(N, (H + 2 * kvh) * hd, generator=gen).to(dtype).to(DEV)
    q = qkv[:, : H * hd].view(N, H, hd)
    k = qkv[:, H * hd : (H + kvh) * hd].view(N, kvh, hd)
    q0, k0, v0 = q.clone(), k.clone(), qkv[:, (H + kvh) * hd :].clone()
    K.rope_(q, k, positions.to(torch.int32), cache)
    q_ref, k_ref = q0.clone(), k0.clone()
    K.rope_ref(q_ref, k_ref, positions, cache)
    assert torch.equal(qkv[:, (H + kvh) * hd :], v0)  # v untouched
    _assert_bitwise_or_1ulp(q, q_ref, min_exact=1.0 if not HAS_CUDA else 0.99)
    _assert_bitwise_or_1ulp(k, k_ref, min_exact=1.0 if not HAS_CUDA else 0.99)
    # the reference is HF's formula
    hf_q = _hf_rope(q0.cpu(), positions.cpu(), hd, theta)
    if HAS_CUDA:  # a cache built on the GPU may differ from HF-on-CPU cos/sin in the last bit
        torch.testing.assert_close(q_ref.cpu().float(), hf_q.float(), rtol=1e-2, atol=1e-2)
    elif dtype == torch.float32:
        torch.testing.assert_close(q_ref, hf_q, rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(q_ref, hf_q)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_and_write_kv(dtype):
    gen = torch.Generator().manual_seed(41)
    N, H, kvh, hd, bs, nb = 4, 4, 2, 16, 4, 5
    cache = K.build_cos_sin_cache(64, hd, 10000.0, device=DEV)
    positions = torch.tensor([3, 0, 9, 17], dtype=torch.int64, device=DEV)
    slots = torch.tensor([6, -1, 15, 0], dtype=torch.int64, device=DEV)
    qkv = torch.randn(N, (H + 2 * kvh) * hd, generator=gen).to(dtype).to(DEV)
    q = qkv[:, : H * hd].view(N, H, hd)
    k = qkv[:, H * hd : (H + kvh) * hd].view(N, kvh, hd)
    v = qkv[:, (H + kvh) * hd :].view(N, kvh, hd)
    q_ref, k0 = q.clone(), k.clone()
    kc = torch.full((nb, bs, kvh, hd), float("nan"), dtype=dtype, device=DEV)
    vc = kc.clone()
    kc_ref, vc_ref = kc.clone(), vc.clone()
    K.rope_and_write_kv(q, k, v, positions, cache, kc, vc, slots)
    K.rope_and_write_kv_ref(q_ref, k0.clone(), v, positions, cache, kc_ref, vc_ref, slots)
    assert torch.equal(k, k0)
    _assert_bitwise_or_1ulp(q, q_ref, min_exact=1.0 if not HAS_CUDA else 0.99)
    assert torch.equal(kc.isnan(), kc_ref.isnan()) and torch.equal(vc.isnan(), vc_ref.isnan())
    written = ~kc_ref.isnan()
    assert written.sum().item() == 3 * kvh * hd
    _assert_bitwise_or_1ulp(kc[written], kc_ref[written], min_exact=1.0 if not HAS_CUDA else 0.99)
    assert torch.equal(vc.nan_to_num(), vc_ref.nan_to_num())


# ---------------------------------------------------------------------------------------------------
# SiLU * up
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype):
    gen = torch.Generator().manual_seed(51)
    N, I = 9, 40
    big = (torch.randn(N, 2 * I + 8, generator=gen) * 3).to(dtype).to(DEV)
    gu = big[:, : 2 * I]  # row stride 2I + 8
    out = torch.full((N, I), float("nan"), dtype=dtype, device=DEV)
    y = K.silu_mul(gu, out=out)
    ref = K.silu_mul_ref(gu)
    assert torch.isfinite(y).all()
    if dtype == torch.float32:
        torch.testing.assert_close(y, ref, rtol=1e-6, atol=1e-6)
    else:
        ulps = _ulp_diff(y, ref)
        assert ulps.max().item() <= 2 and (ulps == 0).float().mean().item() >= 0.97


# ---------------------------------------------------------------------------------------------------
# decode projections (kernels/projections.py)
# ---------------------------------------------------------------------------------------------------

LINEAR_CONFIGS = [
    K.LinearConfig(16, 32, 1, 4, 1, dot=False),  # fma, one split
    K.LinearConfig(16, 16, 3, 4, 1, dot=False),  # fma, serial split-K over 3 uneven slices
    K.LinearConfig(16, 8, 2, 4, 1, dot=False),  # fma, whole chunks: w read one chunk ahead, split-K
    K.LinearConfig(16, 8, 1, 4, 1, dot=False, prefetch=False),  # fma, whole chunks, no read-ahead
    K.LinearConfig(16, 8, 9, 4, 1, dot=False),  # fma, one chunk per split: the slice read before the wait
    K.LinearConfig(16, 16, 3, 4, 1, dot=False, defer_sum=True),  # fma: one reduction after the loop, all rows
    K.LinearConfig(16, 8, 2, 4, 1, dot=False, defer_sum=True),  # the same over whole chunks, read one ahead
    K.LinearConfig(16, 8, 9, 4, 1, dot=False, defer_sum=True),  # the same with one chunk per split
    K.LinearConfig(16, 32, 2, 4, 2, dot=True),  # tensor-core tile
    K.LinearConfig(16, 16, 2, 4, 2, dot=True),  # K not a multiple of BLOCK_K (masked loads), split-K
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("silu_x", [False, True])
@pytest.mark.parametrize("cfg", LINEAR_CONFIGS, ids=lambda c: c.name)
@pytest.mark.parametrize("M", [1, 3, 8, 12])
def test_linear_matches_twin(dtype, silu_x, cfg, M):
    if M > K.projections.MAX_FMA_M and cfg.block_k < 16:
        pytest.skip("beyond MAX_FMA_M rows the tensor-core path runs, which needs BLOCK_K >= 16")
    gen = torch.Generator().manual_seed(71 + M)
    N, Kd = 40, 72  # N not a multiple of BLOCK_N; K = 72: uneven splits and a partial chunk
    x = torch.randn(M, 2 * Kd if silu_x else Kd, generator=gen).to(dtype).to(DEV)
    w = (torch.randn(N, Kd, generator=gen) / Kd**0.5).to(dtype).to(DEV)
    y = K.linear(x, w, silu_x=silu_x, config=cfg)
    assert y.shape == (M, N) and y.dtype == dtype and torch.isfinite(y).all()
    # the product in fp32 of the x the kernel multiplies (the activation rounded to dtype, as silu_mul_ref)
    xr = K.silu_mul_ref(x) if silu_x else x
    exact = xr.float() @ w.float().t()
    if dtype == torch.float32:
        torch.testing.assert_close(y, exact, rtol=1e-5, atol=1e-5)
    else:  # fp32 accumulation, one rounding of the output to bf16 (relative step 2^-8 = 3.9e-3)
        torch.testing.assert_close(y.float(), exact, rtol=8e-3, atol=8e-3)
    if cfg.split_k > 1:  # serial split-K: bitwise reproducible, and the arrival counters re-armed
        assert torch.equal(K.linear(x, w, silu_x=silu_x, config=cfg), y)
        assert torch.equal(K.linear(x, w, silu_x=silu_x, config=cfg), y)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cfg", LINEAR_CONFIGS, ids=lambda c: c.name)
@pytest.mark.parametrize("M", [1, 3, 12])
def test_linear_glu_is_bitwise_the_product_then_the_activation_kernel(dtype, cfg, M):
    """``glu``: gate/up with the activation in its epilogue == the same config's gate/up output, then
    `silu_mul`, bitwise (the same K reductions per column, the same roundings), on both paths, split-K
    included; I = 20 is not a multiple of the tile's BLOCK_N / 2 = 8 output columns."""
    if M > K.projections.MAX_FMA_M and cfg.block_k < 16:
        pytest.skip("beyond MAX_FMA_M rows the tensor-core path runs, which needs BLOCK_K >= 16")
    gen = torch.Generator().manual_seed(91 + M)
    I, Kd = 20, 72
    x = torch.randn(M, Kd, generator=gen).to(dtype).to(DEV)
    w = (torch.randn(2 * I, Kd, generator=gen) / Kd**0.5 * 3).to(dtype).to(DEV)
    y = K.linear(x, w, glu=True, config=cfg)
    assert y.shape == (M, I) and y.dtype == dtype and torch.isfinite(y).all()
    plain = K.linear(x, w, config=cfg)
    if cfg.dot or M > K.projections.MAX_FMA_M:  # the tile's columns are gate/up pairs: another dot shape
        exact = K.silu_mul_ref(x.float() @ w.float().t())
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(y.float(), exact, rtol=tol, atol=tol)
    else:  # CUDA cores reduce each row of w alone: the same sums in the same order as without GLU
        assert torch.equal(y, K.silu_mul(plain)), (y - K.silu_mul(plain)).abs().max()
    if cfg.split_k > 1:
        assert torch.equal(K.linear(x, w, glu=True, config=cfg), y)


def test_l2_ranges_of_a_share_are_whole_rows_of_each_half():
    """`l2_ranges_of`: a gate/up weight (even rows) gets two ranges, one a half, each the share's whole rows;
    an odd row count one range; nothing for share 0 or a share under one row."""
    v = torch.empty(40, 24, dtype=torch.bfloat16)
    assert K.projections.l2_ranges_of(v, 0.25) == (2, 5 * 24, 20 * 24)
    assert K.projections.l2_ranges_of(v, 2.0) == (2, 20 * 24, 20 * 24)
    assert K.projections.l2_ranges_of(torch.empty(5, 16), 0.5) == (1, 2 * 16, 5 * 16)
    assert K.projections.l2_ranges_of(torch.empty(3, 4), 0.5) == (0, 0, 0)  # 4 elements: under 8
    assert K.projections.l2_ranges_of(v, 0.0) == (0, 0, 0)
    assert K.projections.l2_ahead_share(2048, 2048, 1) > 0 and K.projections.l2_ahead_share(2048, 2048, 64) == 0


@pytest.mark.parametrize("cfg", [LINEAR_CONFIGS[0], LINEAR_CONFIGS[-1]], ids=lambda c: c.name)
@pytest.mark.parametrize("M", [1, 12])
def test_linear_with_an_l2_prefetch_of_the_next_weight_is_bitwise_the_same(cfg, M):
    """``next_weight``: the kernel asks L2 for a share of another weight before its PDL wait (on the GPU; the
    interpreter skips the prefetch); the result is bitwise the same, and the other weight is untouched."""
    if M > K.projections.MAX_FMA_M and cfg.block_k < 16:
        pytest.skip("beyond MAX_FMA_M rows the tensor-core path runs, which needs BLOCK_K >= 16")
    gen = torch.Generator().manual_seed(17 + M)
    x = torch.randn(M, 72, generator=gen).to(torch.bfloat16).to(DEV)
    w = torch.randn(40, 72, generator=gen).to(torch.bfloat16).to(DEV)
    nxt = torch.randn(64, 40, generator=gen).to(torch.bfloat16).to(DEV)
    before = nxt.clone()
    plain = K.linear(x, w, config=cfg)
    for share in (0.3, 1.0):
        assert torch.equal(K.linear(x, w, config=cfg, next_weight=nxt, l2_share=share), plain)
    assert torch.equal(nxt, before)


@pytest.mark.parametrize("M", [1, 5, 12])
def test_mlp_routes_the_activation_and_both_routes_agree(monkeypatch, M):
    """`mlp`: with the kernel on gate/up (OURO_LINEAR=kernel runs these toy shapes) the activation goes in
    gate/up's epilogue; with OURO_GLU=0 into down's x load (or its own kernel past MAX_FMA_M rows). Both
    equal the twin; on CUDA cores (M <= 8) they equal each other bitwise."""
    gen = torch.Generator().manual_seed(5 + M)
    H, I = 48, 40
    x = torch.randn(M, H, generator=gen).to(torch.bfloat16).to(DEV)
    gu = (torch.randn(2 * I, H, generator=gen) / H**0.5 * 2).to(torch.bfloat16).to(DEV)
    down = (torch.randn(H, I, generator=gen) / I**0.5).to(torch.bfloat16).to(DEV)
    monkeypatch.setenv("OURO_LINEAR", "kernel")
    calls = []
    real = K.projections.linear
    monkeypatch.setattr(K.projections, "linear", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    y = K.mlp(x, gu, down)
    assert calls == [{"glu": True}, {}]
    monkeypatch.setenv("OURO_GLU", "0")
    calls.clear()
    y_apart = K.mlp(x, gu, down)
    assert calls == [{}, {"silu_x": True}]
    exact = K.silu_mul_ref(x.float() @ gu.float().t()) @ down.float().t()
    torch.testing.assert_close(y.float(), exact, rtol=3e-2, atol=3e-2)
    if M <= K.projections.MAX_FMA_M:
        assert torch.equal(y, y_apart)
    else:
        torch.testing.assert_close(y, y_apart, rtol=2e-2, atol=2e-2)


def test_linear_one_chunk_path_is_the_one_tested_and_the_one_o_uses():
    """The single-chunk read-ahead (``ONE_CHUNK``) is what the split-9 config above runs, and what the table
    picks for the o projection at 1-4 rows; qkv's config there still walks its chunks one ahead."""
    one = K.LinearConfig(16, 8, 9, 4, 1, dot=False)
    assert one in LINEAR_CONFIGS
    assert K.projections.launch_constants(one, 1, 72, torch.bfloat16, False)["ONE_CHUNK"]
    for M in (1, 4):
        o = K.config_for(2048, 2048, M)
        assert o is not None and K.projections.launch_constants(o, M, 2048, torch.bfloat16, False)["ONE_CHUNK"]
    qkv = K.config_for(6144, 2048, 1)
    assert qkv is not None and not K.projections.launch_constants(qkv, 1, 2048, torch.bfloat16, False)["ONE_CHUNK"]
    # beyond MAX_FMA_M rows the tensor-core path runs, which has no read-ahead: never ONE_CHUNK
    whole = K.LinearConfig(16, 64, 1, 4, 1, dot=False)
    assert K.projections.launch_constants(whole, 1, 64, torch.bfloat16, False)["ONE_CHUNK"]
    assert not K.projections.launch_constants(whole, 12, 64, torch.bfloat16, False)["ONE_CHUNK"]


def test_linear_deferred_sum_runs_on_cuda_cores_only():
    """``defer_sum`` (the configs above) is a CUDA-core path for every row count it covers (the twin test runs
    it at 1, 3 and 8 rows); beyond MAX_FMA_M rows the tensor-core path runs and the flag is off."""
    lane_cfg = K.LinearConfig(16, 16, 3, 4, 1, dot=False, defer_sum=True)
    assert lane_cfg in LINEAR_CONFIGS
    for M in (1, 3, K.projections.MAX_FMA_M):
        assert K.projections.launch_constants(lane_cfg, M, 72, torch.bfloat16, True)["DEFER_SUM"]
    beyond = K.projections.MAX_FMA_M + 1
    assert not K.projections.launch_constants(lane_cfg, beyond, 72, torch.bfloat16, True)["DEFER_SUM"]


def test_attn_sweep_reads_back_the_config_names_it_prints():
    """benchmarks/kernels/attn_sweep.py: ``--grid`` takes the names the sweep prints (`name`) back as configs
    (`parse`), for every config of its grid."""
    from benchmarks.kernels.attn_sweep import GRID, name, parse

    assert len({name(c) for c in GRID}) == len(GRID) == 54
    assert all(parse(name(c)) == c for c in GRID)
    assert parse("n64_w2_st3_s1") == dict(block_n=64, num_warps=2, num_stages=3, num_splits=1)


@pytest.mark.parametrize("rows", [2, 20])
def test_attn_sweep_configured_backend_runs_the_engines_attention(rows):
    """attn_sweep.py's loop check: its configured backend takes the engine's path at each row count (fused up
    to FUSED_ROPE_MAX_ROWS rows, RoPE + KV write then attention above) with the config passed through, and
    gives the default backend's output and caches (here the kernels' torch fallbacks: the plumbing, not the
    timing)."""
    from benchmarks.kernels.attn_sweep import config_backend
    from ouro_backend.kernels.backend import TritonBackend
    from ouro_backend.model.attention import AttentionMetadata
    from ouro_backend.model.torch_ops import build_cos_sin_cache

    gen = torch.Generator().manual_seed(rows)
    H = kvh = 2
    hd, bs, ctx = 16, 4, 9
    per_row = -(-ctx // bs)
    tables = torch.arange(rows * per_row, dtype=torch.int32).view(rows, per_row)
    lens = torch.full((rows,), ctx, dtype=torch.int32)
    cu = torch.arange(rows + 1, dtype=torch.int32)
    slots = tables[:, -1].to(torch.int64) * bs + (ctx - 1) % bs
    meta = AttentionMetadata(cu, lens, tables, slots, 1, ctx, cu.tolist(), lens.tolist())
    q, k, v = (torch.randn(rows, n, hd, generator=gen) for n in (H, kvh, kvh))
    kv = torch.randn(2, rows * per_row, bs, kvh, hd, generator=gen)
    pos = torch.full((rows,), ctx - 1, dtype=torch.int64)
    cos_sin = build_cos_sin_cache(ctx, hd, 10000.0)
    cfg = dict(block_n=32, num_warps=2, num_stages=2, num_splits=1)
    outs = []
    for backend in (TritonBackend, config_backend(cfg)):
        caches = kv.clone()
        out = backend.rope_kv_attention(q.clone(), k, v, pos, cos_sin, caches[0], caches[1], meta, hd**-0.5)
        outs.append((out, caches))
    torch.testing.assert_close(outs[1][0].view_as(outs[0][0]), outs[0][0])
    assert torch.equal(outs[0][1], outs[1][1])


def test_a_tunes_choices_replace_the_table_only_where_tuned():
    """benchmarks/kernels/loop_bench.py: a tune's ``table`` output read back (`tuned_choices`) and put in place
    of the table (`table_override`, what ``tune`` and bench_with_tune.py run under): the tuned row counts take
    the tune's choice, cuBLAS included, every other row count the table's, and the table is back afterwards.
    (The benchmarks import the kernels normally, not this file's interpreted copy `K`.)"""
    from benchmarks.kernels.loop_bench import table_override, tuned_choices
    from ouro_backend.kernels import projections

    other = projections.LinearConfig(16, 64, 2, 4, 5)
    chosen = tuned_choices({"qkv": {"2": None, "16": vars(other)}, "down": {}})
    assert chosen == {(6144, 2048, 2): None, (6144, 2048, 16): other}
    table = {M: projections.config_for(6144, 2048, M) for M in (1, 2, 16)}
    assert table[2] is not None and table[16] != other  # what the override gives is not the table's
    with table_override(chosen) as table_for:
        assert projections.config_for(6144, 2048, 2) is None
        assert projections.config_for(6144, 2048, 16) == other
        assert projections.config_for(6144, 2048, 1) == table[1] == table_for(6144, 2048, 1)
    assert {M: projections.config_for(6144, 2048, M) for M in (1, 2, 16)} == table


def test_linear_fused_silu_is_bitwise_the_activation_kernel():
    """silu_x applies exactly `silu_mul`'s rounding: fused == silu_mul then the same kernel, bitwise."""
    gen = torch.Generator().manual_seed(72)
    gu = (torch.randn(5, 2 * 64, generator=gen) * 3).to(torch.bfloat16).to(DEV)
    w = torch.randn(24, 64, generator=gen).to(torch.bfloat16).to(DEV)
    cfg = K.LinearConfig(8, 32, 1, 4, 1, dot=False)
    assert torch.equal(K.linear(gu, w, silu_x=True, config=cfg), K.linear(K.silu_mul(gu), w, config=cfg))


def test_linear_table_routes_decode_shapes_only():
    assert K.config_for(6144, 2048, 1) is not None and K.config_for(2048, 5632, 64) is not None
    assert K.config_for(6144, 2048, 65) is None  # prompt chunks and large M: cuBLAS
    assert K.config_for(123, 456, 1) is None  # unmeasured shape: cuBLAS
    with pytest.raises(AssertionError, match="empty"):  # a split of K with no chunk is refused
        x, w = torch.ones(1, 64, device=DEV), torch.ones(8, 64, device=DEV)
        K.linear(x, w, config=K.LinearConfig(8, 32, 3, dot=False))


# ---------------------------------------------------------------------------------------------------
# CPU fallback (normal import, no interpreter): the public functions route to the references
# ---------------------------------------------------------------------------------------------------


def test_cpu_fallback_plumbing():
    if HAS_CUDA:
        pytest.skip("CUDA present: no CPU fallback in play")
    import ouro_backend.kernels as KN

    if kernel_is_interpreted(sys.modules["ouro_backend.kernels.attention"]._paged_attn_kernel):
        pytest.skip("TRITON_INTERPRET was set for the whole process")
    gen = torch.Generator().manual_seed(61)
    q, kc, vc, cu, sl, bt = _make_batch([1, 3], [4, 3], 4, 2, 16, 4, torch.float32, gen)
    out = torch.full(q.shape, float("nan"))
    KN.paged_attention(q, kc, vc, cu, sl, bt, 0.25, 3, out=out)
    torch.testing.assert_close(out, K.paged_attention(q, kc, vc, cu, sl, bt, 0.25, 3), rtol=1e-5, atol=2e-5)
    x = torch.randn(3, 8, generator=gen)
    w = torch.rand(8, generator=gen)
    torch.testing.assert_close(KN.rms_norm(x, w, 1e-6), K.rms_norm(x, w, 1e-6))
    torch.testing.assert_close(KN.silu_mul(torch.cat([x, x], 1)), K.silu_mul(torch.cat([x, x], 1)))


# ---------------------------------------------------------------------------------------------------
# Device compilation without a device: every kernel through Triton's NVIDIA backend + bundled ptxas
# ---------------------------------------------------------------------------------------------------


def _aot_check(*args: str) -> subprocess.CompletedProcess:
    """benchmarks/kernels/aot_check.py in a subprocess: the interpreter leaves triton.language patched in
    this one."""
    import triton

    if not os.path.isdir(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia")):
        pytest.skip("this Triton build has no NVIDIA backend")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, os.path.join("benchmarks", "kernels", "aot_check.py"), *args]
    return subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)


def test_kernels_compile_for_sm90():
    """The interpreter accepts code the GPU compiler rejects: compile every kernel for an H200 (sm_90)."""
    r = _aot_check("--arch", "90")
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]


@pytest.mark.parametrize("spec", ["1x64+0", "2x32+40", "1x20+37/2x16+0"])
def test_prefill_attn_sweep_lays_out_sdpa_as_the_paged_kernel_reads(spec):
    """benchmarks/kernels/prefill_attn_sweep.py's SDPA side (its speed yardstick) attends over the same keys, in
    the same causal alignment, as `paged_attention` over the scattered blocks: a fresh prompt (is_causal), a
    chunk after cached tokens (bottom-right mask), and rows of both kinds in one case (a chunk that continues a
    prompt, then new ones), compared on the CPU (the torch reference)."""
    from benchmarks.kernels.prefill_attn_sweep import Case, parse_case

    case = Case(parse_case(spec), device="cpu", layers=1)
    assert case.label == spec
    run, out = case.sdpa()
    run()
    kc, vc = case.kv[0, 0], case.kv[0, 1]
    ref = K.paged_attention_ref(case.q, kc, vc, case.cu, case.lens, case.tables, 128**-0.5, case.max_q)
    torch.testing.assert_close(out().float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_round_profile_tells_attention_launches_apart_by_grid():
    """benchmarks/round_profile.py --prompt-tokens: a chunk's attention launches and the decode rows' launches of
    the same kernel beside them are grouped apart by grid (from the profiler's chrome trace), other kinds and
    non-kernel events left out, the longest group first."""
    from benchmarks.round_profile import launches_by_grid

    def kernel(name, grid, dur, cat="kernel"):
        return {"ph": "X", "cat": cat, "name": name, "dur": dur, "args": {"grid": grid, "block": [128, 1, 1]}}

    trace = {
        "traceEvents": [
            kernel("_paged_attn_kernel", [512, 1, 1], 70.0),
            kernel("_paged_attn_kernel", [1, 16, 64], 3.0),
            kernel("_paged_attn_kernel", [512, 1, 1], 74.0),
            kernel("_paged_attn_kernel", [1, 16, 64], 5.0),
            kernel("_paged_attn_kernel", [512, 1, 1], 90.0),
            kernel("nvjet_sm90_tst_192x192", [66, 2, 1], 200.0),
            kernel("_paged_attn_kernel", [512, 1, 1], 1.0, cat="cuda_runtime"),
        ]
    }
    assert launches_by_grid(trace, "attention") == [
        dict(name="_paged_attn_kernel", grid=[512, 1, 1], launches=3, total_us=234.0, median_us=74.0),
        dict(name="_paged_attn_kernel", grid=[1, 16, 64], launches=2, total_us=8.0, median_us=4.0),
    ]
    assert launches_by_grid(trace, "gemm")[0]["launches"] == 1 and launches_by_grid({}, "attention") == []


def test_round_profile_busy_window_runs_and_leaves_the_engine_empty(toy_path, monkeypatch):
    """benchmarks/round_profile.py --busy: the window steps a running engine (prompt chunks and decode rows) under
    the profiler, then aborts its requests: none is left and every KV block is free. On the CPU the profiler
    records CPU ops (no CUDA activity) and the launch timer is off, so only the mechanics are checked here."""
    from torch.profiler import ProfilerActivity, profile

    import benchmarks.round_profile as rp
    from ouro_backend import LLMEngine
    from ouro_backend.config import EngineConfig

    monkeypatch.setattr(rp, "profile", lambda activities: profile(activities=[ProfilerActivity.CPU]))
    eng = LLMEngine(
        EngineConfig(model=toy_path, block_size=4, device="cpu", dtype="float32", num_blocks=512, max_num_seqs=8,
                     max_num_batched_tokens=64)
    )  # fmt: skip
    rep = rp.busy_profile(eng, 40, 4, 3)
    assert rep["concurrency"] == 4 and rep["plain_by_kind"] == {} and rep["plain_wall_ms"] > 0
    assert eng.get_num_unfinished_requests() == 0 and eng.kv.pool.num_available == eng.kv.num_blocks


def test_aot_check_compiles_a_sweeps_candidates(tmp_path):
    """``--sweep``: only the candidates of a sweep JSON, each at its row count (defer_sum at 3 rows here), with
    and without the fused SiLU; one the shape cannot take (an empty split of K) fails alone, by name, and one
    the sweep marked failed is skipped."""
    cfg = K.LinearConfig(4, 512, 1, 4, 1, dot=False, defer_sum=True)
    empty = K.LinearConfig(4, 512, 8, 4, 1, dot=False)  # 11 chunks of K=5632 in 8 splits: the last is empty
    marked = K.LinearConfig(8, 512, 1, 4, 1, dot=False)
    configs = [{"ok": ok, "us": 0.0, "config": vars(c)} for ok, c in ((True, cfg), (True, empty), (False, marked))]
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"sweep": [{"N": 2048, "K": 5632, "M": 3, "configs": configs}]}))
    r = _aot_check("--arch", "90", "--sweep", str(path))
    assert r.returncode == 1, r.stdout[-6000:] + r.stderr[-3000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("linear ")]
    assert [ln.split()[:4] for ln in lines] == [["linear", "2048x5632", "M<=3", c.name] for c in (cfg, cfg, empty)]
    assert " ok " in lines[0] and "silu_x" in lines[1] and " ok " in lines[1]
    assert "FAILED: invalid config" in lines[2] and "is empty" in lines[2]
    assert r.stdout.rstrip().endswith("1 FAILED")


def test_ptx_hash_ignores_debug_info_only():
    """``aot_check --ptx-hash``: source lines and DWARF do not count (a refactor that moves lines keeps the hash),
    an instruction does."""
    from benchmarks.kernels.aot_check import ptx_hash

    code = "\t.loc\t1 12 4\n\tld.global.v4.b32 {%r1, %r2, %r3, %r4}, [%rd1];\n"
    debug = "\t.section\t.debug_info\n\t.b8 127 // DW_AT_call_line\n"
    moved = code.replace(".loc\t1 12 4", ".loc\t1 13 4")
    assert ptx_hash(code + debug) == ptx_hash(moved + debug.replace("127", "128"))
    assert ptx_hash(code + debug) != ptx_hash(code.replace("v4.b32", "v2.b32") + debug)


# ---------------------------------------------------------------------------------------------------
# the decode state machine: fused kernels vs their torch twins (DecodeState, ouro_backend/engine/decode_state.py)
# ---------------------------------------------------------------------------------------------------


def _random_state(dtype, gen, slots=7, T=4, blocks=6, H=40, V=50):
    from ouro_backend.engine import decode_state as ds
    from ouro_backend.engine.decode_state import DecodeState

    st = DecodeState(slots, T, blocks, H, dtype, torch.device(DEV), block_size=4, last_exited=True, eos_ids=[])
    r = lambda lo, hi: torch.randint(lo, hi, (slots,), generator=gen)  # noqa: E731
    ints = torch.zeros(slots, ds.NUM_INTS, dtype=torch.int64)
    ints[:, ds.ACTIVE] = r(0, 2)
    ints[:, ds.TOKEN] = r(0, V)
    ints[:, ds.POS] = r(0, blocks * 4)
    ints[:, ds.LOOP] = r(1, T + 1)
    ints[:, ds.NGEN] = r(0, 5)
    ints[:, ds.PENDING] = r(0, 2)
    ints[:, ds.MIN_LOOPS] = r(1, 3)
    ints[:, ds.MAX_LOOPS] = r(2, T + 1)
    ints[:, ds.MAX_TOKENS] = r(1, 6)
    ints[:, ds.MIN_TOKENS] = r(0, 3)
    ints[:, ds.IGNORE_EOS] = r(0, 2)
    ints[:, ds.TRACE_LEN] = r(1, 5)
    st.ints.copy_(ints)
    thr = torch.tensor([0.0, 0.3, 0.5, 0.7, 0.8, 1.0, 0.95], dtype=torch.float64)[torch.randperm(7, generator=gen)]
    st.floats[:, ds.THRESHOLD] = thr[:slots].to(DEV)
    st.remaining.copy_(torch.rand(slots, generator=gen))
    st.trace.copy_(torch.randint(1, T + 1, st.trace.shape, generator=gen))
    st.tables.copy_(torch.randint(0, 30, st.tables.shape, generator=gen, dtype=torch.int32))
    st.hidden.copy_(torch.randn(slots, H, generator=gen).to(dtype))
    embed = torch.randn(V, H, generator=gen).to(dtype).to(DEV)
    return st, embed


def _clone_state(st, last_exited=True, eos_ids=()):
    """A copy of `st` (its tensors cloned) whose methods run the torch twins (the kernels here are this
    module's interpreted copy, called directly)."""
    from ouro_backend.engine.decode_state import DecodeState

    c = DecodeState(
        st.num_slots,
        st.num_loops,
        st.max_blocks,
        st.hidden.shape[1],
        st.hidden.dtype,
        st.device,
        block_size=st.block_size,
        last_exited=last_exited,
        eos_ids=list(eos_ids),
        fused=False,
    )
    for name in ("ints", "floats", "remaining", "trace", "tables", "hidden"):
        getattr(c, name).copy_(getattr(st, name))
    return c


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("last_exited", [True, False])
def test_decode_prepare_matches_twin(dtype, last_exited):
    gen = torch.Generator().manual_seed(5)
    st, embed = _random_state(dtype, gen)
    idx = torch.tensor([4, 0, 6, 2, 3], device=DEV)
    from ouro_backend.engine import decode_state as ds
    from ouro_backend.engine.decode_state import DecodeInputs

    got = DecodeInputs(*K.decode_step.prepare(st, idx, embed, 4, last_exited, ds.COLUMNS))
    want = _clone_state(st, last_exited).decode_inputs(idx, embed)
    for name in ("pos", "kv_slot", "seq_lens", "tables", "h", "kv_slots"):
        g, w = getattr(got, name), getattr(want, name)
        assert g.dtype == w.dtype and torch.equal(g.cpu(), w.cpu()), name
    assert (want.kv_slot == -1).any() and (want.kv_slot >= 0).any()


@pytest.mark.parametrize("mode", ["ouro", "ouro_delayed", "random_lookahead", "trace", "fixed"])
@pytest.mark.parametrize("last_exited", [True, False])
def test_decode_advance_matches_twin(mode, last_exited):
    """Every column of the next state, the hazard, the record and the fill pairs, bit for bit, over rows
    that exit, continue, stop on max_tokens or EOS, and idle rows."""
    from ouro_backend.config import ExitMode
    from ouro_backend.engine import decode_state as ds

    gen = torch.Generator().manual_seed(11)
    exits, stops = 0, set()
    for trial in range(4):
        st, _ = _random_state(torch.float32, gen)
        idx = torch.tensor([1, 5, 0, 3, 6, 2], device=DEV)
        S, T = idx.shape[0], st.num_loops
        lam = torch.rand(S, generator=gen).to(DEV)
        tok = torch.randint(0, 50, (S,), generator=gen).to(DEV)
        lp = -torch.rand(S, generator=gen).to(DEV)
        slots_all = torch.randint(0, 100, (S, T), generator=gen).to(DEV)
        eos = [int(tok[0]), int(tok[3])]
        a, b = _clone_state(st, last_exited, eos), _clone_state(st, last_exited, eos)
        rec_a, rec_b = a.new_record(1)[0], b.new_record(1)[0]
        sa, da = K.decode_step.advance(
            a, idx, lam, tok, lp, slots_all, a.eos, rec_a, ExitMode(mode), last_exited, ds.COLUMNS
        )
        sb, db = b.advance(idx, lam, tok, lp, slots_all, rec_b, ExitMode(mode))
        for name in ("ints", "remaining"):
            assert torch.equal(getattr(a, name).cpu(), getattr(b, name).cpu()), (trial, name)
        idle = idx[st.ints[idx, ds.ACTIVE] == 0]  # rows waiting to resume ride along masked in graphs
        assert idle.numel() > 0
        assert torch.equal(b.ints[idle].cpu(), st.ints[idle].cpu()), "an idle row's next step changed"
        assert torch.equal(b.remaining[idle].cpu(), st.remaining[idle].cpu()), "an idle row's hazard changed"
        assert (
            torch.equal(rec_a.cpu(), rec_b.cpu())
            and torch.equal(sa.cpu(), sb.cpu())
            and torch.equal(da.cpu(), db.cpu())
        )
        exits += int((rec_b[0] > 0).sum())
        stops |= set(rec_b[0].tolist())
    assert exits > 0
    assert {ds.EMIT_EOS, ds.EMIT_LENGTH} & stops, "the trials should cover the device's stop rules"


# ---------------------------------------------------------------------------------------------------
# the fused greedy coda (kernels/coda.py)
# ---------------------------------------------------------------------------------------------------

CODA_SMALL = K.coda.CodaConfig(block_v=4, block_k=16, num_warps=4, programs_per_sm=1)


def _coda_round(gen, dtype, M, V=53, H=48):
    """Loop output h [M, H], an LM head [V, H] (V not a multiple of the tile) and slots whose rows are
    active, the second at its last loop (so it exits in every mode but trace)."""
    from ouro_backend.engine import decode_state as ds

    st, _ = _random_state(torch.float32, gen)
    idx = torch.randperm(st.num_slots, generator=gen)[:M].to(DEV)
    st.ints[idx, ds.ACTIVE] = 1
    j = idx[min(1, M - 1)]
    st.ints[j, ds.LOOP] = st.ints[j, ds.MAX_LOOPS]
    h = torch.randn(M, H, generator=gen).to(dtype).to(DEV)
    w = (torch.randn(V, H, generator=gen) / H**0.5).to(dtype).to(DEV)
    lam = torch.rand(M, generator=gen).to(DEV)
    return st, idx, h, w, lam


CODA_DOT = K.coda.CodaConfig(block_v=16, block_k=16, num_warps=4, programs_per_sm=1, dot=True, num_stages=2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "M,programs,cfg",
    [(1, 1, CODA_SMALL), (3, 5, CODA_SMALL), (7, 7, CODA_SMALL), (2, 14, CODA_SMALL), (3, 2, CODA_DOT)],
)
def test_greedy_coda_matches_twin(dtype, M, programs, cfg):
    """Tokens and logprobs of the plain coda (``h @ lm_head.T`` in h's dtype, argmax, log_softmax) from
    one kernel, on CUDA cores and on tensor cores, over grids that split the vocabulary unevenly (14
    programs: some own no tile)."""
    from ouro_backend.config import ExitMode
    from ouro_backend.engine import decode_state as ds
    from ouro_backend.model.torch_ops import greedy_coda_ref

    st, idx, h, w, lam = _coda_round(torch.Generator().manual_seed(31 + M), dtype, M)
    tok, lp = K.coda.greedy_coda(h, w, st, idx, lam, ExitMode.OURO, ds.COLUMNS, cfg, programs=programs)
    want_tok, want_lp = greedy_coda_ref(h, w)
    assert tok.dtype == torch.int64 and lp.dtype == torch.float32 and tok.shape == lp.shape == (M,)
    if dtype == torch.float32:
        assert torch.equal(tok.cpu(), want_tok.cpu())
        torch.testing.assert_close(lp, want_lp, rtol=1e-5, atol=1e-6)
    else:  # fp32 sums in another order, each logit rounded to bf16: a token may differ only on a tie there
        logits = (h @ w.t()).float()
        chosen = logits.gather(1, tok[:, None])[:, 0]
        assert torch.equal(tok.cpu(), want_tok.cpu()) or bool((_ulp_diff(chosen, logits.max(-1).values) <= 1).all())
        torch.testing.assert_close(lp, want_lp, rtol=0, atol=2e-2)
    # the arrival counter was re-armed: a second call gives the same bits
    tok2, lp2 = K.coda.greedy_coda(h, w, st, idx, lam, ExitMode.OURO, ds.COLUMNS, cfg, programs=programs)
    assert torch.equal(tok2, tok) and torch.equal(lp2, lp)


def test_greedy_coda_breaks_ties_to_the_lowest_token_as_argmax():
    """Two vocabulary rows with the same (largest) logit in different programs' ranges: the lower id wins."""
    from ouro_backend.config import ExitMode
    from ouro_backend.engine import decode_state as ds

    st, idx, h, w, lam = _coda_round(torch.Generator().manual_seed(5), torch.float32, 2)
    w[7] = w[45] = h[0] * 4  # row 0's maximum, twice (tiles 1 and 11 of 4 rows; 5 programs own 2-3 tiles)
    w[3] = w[44] = h[1] * 4
    tok, _ = K.coda.greedy_coda(h, w, st, idx, lam, ExitMode.OURO, ds.COLUMNS, CODA_SMALL, programs=5)
    assert tok.tolist() == [7, 3] == (h @ w.t()).argmax(-1).tolist()


@pytest.mark.parametrize("mode", ["ouro", "ouro_delayed", "random_lookahead", "trace", "fixed"])
def test_greedy_coda_runs_exactly_when_advance_emits(mode):
    """The kernel's own exit decision is `advance`'s: over random rows (idle ones included), it computes the
    coda exactly when the torch rule has some row emit, and otherwise returns token 0 and logprob 0 without
    the LM head (here all NaN, so any use of it would show)."""
    from ouro_backend.config import ExitMode
    from ouro_backend.engine import decode_state as ds
    from ouro_backend.model.torch_ops import greedy_coda_ref

    gen = torch.Generator().manual_seed(17)
    seen = set()
    for trial in range(12):
        st, _ = _random_state(torch.float32, gen)
        M = 1 + trial % 3
        idx = torch.randperm(st.num_slots, generator=gen)[:M].to(DEV)
        h = torch.randn(M, 48, generator=gen).to(DEV)
        lam = torch.rand(M, generator=gen).to(DEV)
        rec = st.new_record(1)[0]
        zero, slots = torch.zeros(M, dtype=torch.long, device=DEV), torch.zeros(M, st.num_loops, dtype=torch.long)
        _clone_state(st).advance(idx, lam, zero, lam, slots.to(DEV), rec, ExitMode(mode))
        emits = bool((rec[0] > 0).any())
        seen.add(emits)
        w = torch.randn(53, 48, generator=gen).to(DEV)
        if not emits:
            w = torch.full_like(w, float("nan"))
        tok, lp = K.coda.greedy_coda(h, w, st, idx, lam, ExitMode(mode), ds.COLUMNS, CODA_SMALL, programs=3)
        if emits:
            want_tok, want_lp = greedy_coda_ref(h, w)
            assert torch.equal(tok.cpu(), want_tok.cpu()) and torch.allclose(lp, want_lp, atol=1e-6), trial
        else:
            assert tok.tolist() == [0] * M and lp.tolist() == [0.0] * M, trial
    assert seen == {True, False}, "the trials should cover rounds with and without an exit"


@pytest.mark.skipif(not HAS_CUDA, reason="the Ouro LM head at full size: GPU only")
@pytest.mark.parametrize("M", [1, 2, 5, 8, 16, 40, 64])
def test_greedy_coda_on_the_real_lm_head(M):
    """The Ouro-1.4B/2.6B LM head (49152 x 2048, bf16) at the table's config for M rows (CUDA cores to 8 rows,
    tensor cores beyond): the plain coda's tokens (or a tie within one bf16 step) and logprobs."""
    from ouro_backend.config import ExitMode
    from ouro_backend.engine import decode_state as ds
    from ouro_backend.engine.decode_state import DecodeState
    from ouro_backend.model.torch_ops import greedy_coda_ref

    gen = torch.Generator(device="cuda").manual_seed(M)
    st = DecodeState(64, 4, 8, 2048, torch.bfloat16, torch.device("cuda"), block_size=16, last_exited=True, eos_ids=[])
    st.ints[:, ds.ACTIVE] = 1
    st.ints[:, ds.LOOP] = st.ints[:, ds.MAX_LOOPS] = 4
    h = torch.randn(M, 2048, generator=gen, device="cuda").bfloat16()
    w = (torch.randn(49152, 2048, generator=gen, device="cuda") / 2048**0.5).bfloat16()
    idx = torch.randperm(64, device="cuda")[:M]
    tok, lp = K.coda.greedy_coda(h, w, st, idx, None, ExitMode.FIXED, ds.COLUMNS)
    want_tok, want_lp = greedy_coda_ref(h, w)
    logits = (h @ w.t()).float()
    top, chosen = logits.max(-1).values, logits.gather(1, tok[:, None])[:, 0]
    assert torch.equal(tok, want_tok) or bool((top - chosen <= top.abs() * 2**-7).all())
    torch.testing.assert_close(lp, want_lp, rtol=0, atol=2e-2)


@pytest.mark.skipif(not HAS_CUDA, reason="decode attention at the engine's launch config: GPU only")
@pytest.mark.parametrize("rows", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("context", [37, 256, 1500])
def test_rope_kv_attention_at_the_engines_config_on_the_real_shape(rows, context):
    """The fused decode attention as the engine launches it (`auto_num_splits`, `_attn_config`'s tiles: at one
    row 8 splits of multiples of 32 keys in 64-key tiles) for 16 heads of 128 in bf16, against the torch twin."""
    gen = torch.Generator().manual_seed(rows * 7 + context)
    H = kvh = 16
    hd, bs = 128, 16
    seq_lens = [context + r for r in range(rows)]
    q, kc, vc, cu, sl, bt = _make_batch([1] * rows, seq_lens, H, kvh, hd, bs, torch.bfloat16, gen)
    positions, slots = _decode_positions_and_slots(seq_lens, bt, bs)
    k = torch.randn(rows, kvh, hd, generator=gen).to(torch.bfloat16).to(DEV)
    v = torch.randn(rows, kvh, hd, generator=gen).to(torch.bfloat16).to(DEV)
    cache = K.build_cos_sin_cache(4096, hd, 10000.0, device=DEV)
    kc2, vc2 = kc.clone(), vc.clone()
    got = K.rope_kv_attention(q, k, v, positions, cache, kc, vc, slots, cu, sl, bt, hd**-0.5, prefetch_kv=True)
    want = K.rope_kv_attention_ref(q, k, v, positions, cache, kc2, vc2, slots, cu, sl, bt, hd**-0.5)
    assert torch.equal(kc.nan_to_num(7.0), kc2.nan_to_num(7.0)) and torch.equal(vc.nan_to_num(7.0), vc2.nan_to_num(7.0))
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


TABLE_ROWS = [(shape, m) for shape, rows in K.projections.DECODE_TABLE.items() for m, cfg in rows if cfg is not None]


@pytest.mark.skipif(not HAS_CUDA, reason="the measured table's shapes at full size: GPU only")
@pytest.mark.parametrize("shape,M", TABLE_ROWS)
def test_linear_table_configs_on_real_shapes(shape, M):
    """Every config the engine picks for the Ouro-1.4B/2.6B projections, at the largest M it serves,
    against an fp32 product."""
    N, Kd = shape
    silu_x = shape == (2048, 5632)
    gen = torch.Generator(device="cuda").manual_seed(M)
    x = torch.randn(M, 2 * Kd if silu_x else Kd, generator=gen, device="cuda").to(torch.bfloat16)
    w = (torch.randn(N, Kd, generator=gen, device="cuda") / Kd**0.5).to(torch.bfloat16)
    cfg = K.config_for(N, Kd, M)
    y = K.linear(x, w, silu_x=silu_x, config=cfg)
    ref = (K.silu_mul(x) if silu_x else x).float() @ w.float().t()
    err = ((y.float() - ref).norm() / ref.norm()).item()
    assert torch.isfinite(y).all() and err < 5e-3, (cfg.name, err)
    if cfg.split_k > 1:
        assert torch.equal(K.linear(x, w, silu_x=silu_x, config=cfg), y)


def test_prefill_attn_sweep_graph_rows_launch_gives_the_rows_output():
    """benchmarks/kernels/prefill_attn_sweep.py's ``--graph-rows``: the case padded with empty rows and launched
    for the whole query buffer (as a mixed graph launches it) gives bitwise the output of the plain launch."""
    from benchmarks.kernels.prefill_attn_sweep import Case

    plain, padded = (Case([(32, 40)] * 2, device="cpu", layers=1, graph_rows=g) for g in (0, 5))
    assert padded.lens.tolist() == [72, 72, 0, 0, 0] and padded.max_q == 64 and padded.cu.tolist()[-1] == 64
    plain.call(0, {})
    padded.call(0, {})
    assert torch.equal(plain.out, padded.out)
