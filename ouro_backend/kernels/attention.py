"""Paged-KV attention kernels (Triton) with plain-torch references.

Layout contract (docs/model.md, "KV cache layouts"):

* KV cache, per layer: ``k_cache``, ``v_cache`` of shape ``[num_blocks, block_size, num_kv_heads, head_dim]``
  (any strides; normally contiguous views ``kv[l, 0]`` / ``kv[l, 1]`` of one
  ``[num_layers, 2, num_blocks, block_size, kvh, hd]`` tensor).
* A batch has R rows. Row r has ``n_r = cu_seqlens_q[r+1] - cu_seqlens_q[r]`` query tokens, flattened into
  ``q: [N, num_heads, head_dim]``. ``seq_lens[r]`` is the KV length of row r *including* this step's tokens;
  query i of row r sits at position ``seq_lens[r] - n_r + i`` and attends causally to positions ``0..pos``.
* ``block_tables[r, p // block_size]`` is the physical block of position p of row r.
* ``slot_mapping[n] = block * block_size + offset`` is where token n's new K/V goes; ``-1`` = pad, skipped.
* GQA: head h reads kv head ``h // (num_heads // num_kv_heads)``.
* All address arithmetic is int64.

Functions: ``write_kv``, ``paged_attention``, ``rope_kv_attention`` (decode: RoPE and the KV write inside
attention), ``copy_kv_slots`` (+ ``*_ref`` torch references).
On CPU tensors without ``TRITON_INTERPRET=1`` the public functions fall back to their references.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..model.torch_ops import (  # the torch twins
    copy_kv_slots_ref,
    paged_attention_ref,
    rope_kv_attention_ref,
    write_kv_ref,
)
from ._common import (
    arrival_counters,
    cast_rne,
    kernel_is_interpreted,
    next_pow2,
    pdl_enter,
    pdl_launch,
    round_f32,
    sm_count,
    use_triton,
)
from .rope import check_rope_args

_LOG2E = 1.4426950408889634


# ----------------------------------------------------------------------------------------------------
# write_kv
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    kc_ptr,
    vc_ptr,
    slot_ptr,
    stride_kn,
    stride_kh,
    stride_kd,
    stride_vn,
    stride_vh,
    stride_vd,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INTERP: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    n = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + n).to(tl.int64)
    if slot < 0:
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H).to(tl.int64)[:, None]
    d = tl.arange(0, BLOCK_D).to(tl.int64)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    k = tl.load(k_ptr + n * stride_kn + h * stride_kh + d * stride_kd, mask=mask)
    v = tl.load(v_ptr + n * stride_vn + h * stride_vh + d * stride_vd, mask=mask)
    kc_dtype: tl.constexpr = kc_ptr.dtype.element_ty
    vc_dtype: tl.constexpr = vc_ptr.dtype.element_ty
    if k.dtype != kc_dtype:
        k = cast_rne(k.to(tl.float32), kc_dtype, INTERP)
    if v.dtype != vc_dtype:
        v = cast_rne(v.to(tl.float32), vc_dtype, INTERP)
    tl.store(kc_ptr + blk * stride_kcb + off * stride_kcs + h * stride_kch + d * stride_kcd, k, mask=mask)
    tl.store(vc_ptr + blk * stride_vcb + off * stride_vcs + h * stride_vch + d * stride_vcd, v, mask=mask)


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter this step's K/V (``[N, kvh, hd]``, any strides) into the paged caches at
    ``slot_mapping`` (int64 ``[N]``; ``-1`` = pad row, nothing written)."""
    N, kvh, hd = k.shape
    assert v.shape == k.shape, (v.shape, k.shape)
    assert k_cache.dim() == 4 and k_cache.shape[2:] == (kvh, hd), (k_cache.shape, k.shape)
    assert v_cache.shape == k_cache.shape
    assert slot_mapping.shape == (N,)
    if N == 0:
        return
    if not use_triton(_write_kv_kernel, k, k_cache):
        return write_kv_ref(k, v, k_cache, v_cache, slot_mapping)
    bd = next_pow2(hd)
    bh = next_pow2(kvh)
    _write_kv_kernel[(N,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        *k.stride(),
        *v.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        BLOCK_SIZE=k_cache.shape[1],
        NUM_KV_HEADS=kvh,
        HEAD_DIM=hd,
        BLOCK_H=bh,
        BLOCK_D=bd,
        INTERP=kernel_is_interpreted(_write_kv_kernel),
        num_warps=4 if bh * bd >= 1024 else 1,
        **pdl_launch(_write_kv_kernel, k.device),
    )


# ----------------------------------------------------------------------------------------------------
# copy_kv_slots (LAST_EXITED exit fill)
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _copy_kv_slots_kernel(
    kv_ptr,
    src_ptr,
    dst_ptr,
    stride_l,
    stride_kv,
    stride_b,
    stride_s,
    stride_h,
    stride_d,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    lk = tl.program_id(1).to(tl.int64)  # layer * 2 + (0: K, 1: V)
    src = tl.load(src_ptr + i).to(tl.int64)
    dst = tl.load(dst_ptr + i).to(tl.int64)
    if (src < 0) | (dst < 0):
        return
    base = (lk // 2) * stride_l + (lk % 2) * stride_kv
    src_off = base + (src // BLOCK_SIZE) * stride_b + (src % BLOCK_SIZE) * stride_s
    dst_off = base + (dst // BLOCK_SIZE) * stride_b + (dst % BLOCK_SIZE) * stride_s
    h = tl.arange(0, BLOCK_H).to(tl.int64)[:, None]
    d = tl.arange(0, BLOCK_D).to(tl.int64)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    inner = h * stride_h + d * stride_d
    x = tl.load(kv_ptr + src_off + inner, mask=mask)
    tl.store(kv_ptr + dst_off + inner, x, mask=mask)


def copy_kv_slots(kv_all_layers: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """For every layer and both K and V of ``kv_all_layers [L, 2, num_blocks, block_size, kvh, hd]``,
    copy slot ``src_slots[i]`` to slot ``dst_slots[i]`` (int64 ``[M]``; a pair with a negative entry is
    skipped). One launch. The destination slots must be distinct and disjoint from the source slots
    (true for the exit fill: one position copied from plane e into planes e+1..T)."""
    assert kv_all_layers.dim() == 6 and kv_all_layers.shape[1] == 2, kv_all_layers.shape
    assert src_slots.shape == dst_slots.shape and src_slots.dim() == 1
    M = src_slots.shape[0]
    if M == 0:
        return
    if not use_triton(_copy_kv_slots_kernel, kv_all_layers):
        return copy_kv_slots_ref(kv_all_layers, src_slots, dst_slots)
    L, _, _, bs, kvh, hd = kv_all_layers.shape
    bh, bd = next_pow2(kvh), next_pow2(hd)
    _copy_kv_slots_kernel[(M, 2 * L)](
        kv_all_layers,
        src_slots,
        dst_slots,
        *kv_all_layers.stride(),
        BLOCK_SIZE=bs,
        NUM_KV_HEADS=kvh,
        HEAD_DIM=hd,
        BLOCK_H=bh,
        BLOCK_D=bd,
        num_warps=4 if bh * bd >= 1024 else 1,
    )


# ----------------------------------------------------------------------------------------------------
# paged attention
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _paged_attn_kernel(
    q_ptr,
    kc_ptr,
    vc_ptr,
    out_ptr,
    o_part_ptr,
    lse_part_ptr,
    cu_q_ptr,
    seq_lens_ptr,
    bt_ptr,
    count_ptr,  # COMBINE: split arrival counters per tile (`_common.arrival_counters`)
    pos_ptr,  # ROPE: positions, cos/sin cache, the new tokens' raw k and v, their KV slots
    cs_ptr,
    kn_ptr,
    vn_ptr,
    slot_ptr,
    qk_scale,  # softmax scale * log2(e)
    num_tokens,
    num_rows,
    stride_qn,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_on,
    stride_oh,
    stride_od,
    stride_bt,
    stride_cs,
    stride_knn,
    stride_knh,
    stride_knd,
    stride_vnn,
    stride_vnh,
    stride_vnd,
    NUM_HEADS: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr,
    G_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLIT_GRAIN: tl.constexpr,
    FIRST_N: tl.constexpr,
    ROPE: tl.constexpr,
    PREFETCH_KV: tl.constexpr,
    DOT_PREC: tl.constexpr,
    INTERP: tl.constexpr,
    PACKED_TILES: tl.constexpr,
    PDL: tl.constexpr,
):
    # grid: (q_tiles * NUM_SPLITS, num_kv_heads, R), or with PACKED_TILES (prompt launches, no splits)
    # ((num_tokens // BLOCK_Q + R) * num_kv_heads, 1, 1): every row's q tiles packed one after another (row r's
    # slots from cu_q[r] // BLOCK_Q + r, `_tile_row`): a program for each tile that holds queries, at most one
    # empty one a row and one per BLOCK_Q tokens of q past the rows' (a graph's padding). The rectangular grid
    # would give every row max_seqlen_q's tiles, and a mixed graph's launch has max_num_seqs rows and its
    # token bucket as max_seqlen_q. Kv heads vary fastest, rows run in order and each row's tiles last first,
    # so the tiles with the most keys start in the first wave: a row's last tiles see the most of its keys, and
    # the scheduler puts the chunks that continue a prompt (keys cached before them) ahead of new prompts'.
    # One program = BLOCK_Q query tokens of one row x the
    # G query heads sharing one kv head (tile row m -> token m // G_PAD, head m % G_PAD), one KV split.
    # PREFETCH_KV (decode with RoPE; the caller's promise that the kernel launched just before this one
    # writes none of them): the row's metadata, the rotation and the split's first tile of cached keys
    # and values are read before the PDL wait, through L2 (.cg), so they load under that kernel's tail.
    # NOTE every kernel launched before the previous one has finished by then (`_common.pdl_enter`).
    if not PREFETCH_KV:
        pdl_enter(PDL)
    CACHE: tl.constexpr = ".cg" if PREFETCH_KV else ""
    pid0 = tl.program_id(0)
    if PACKED_TILES:
        NUM_KV_HEADS: tl.constexpr = NUM_HEADS // QUERIES_PER_KV
        kvh = pid0 % NUM_KV_HEADS
        t = pid0 // NUM_KV_HEADS
        row = _tile_row(cu_q_ptr, t, num_rows, BLOCK_Q)
        q_start = tl.load(cu_q_ptr + row)
        q_end = tl.load(cu_q_ptr + row + 1)
        q_tile = q_end // BLOCK_Q + row - t  # row r's slots cu_q[r] // BLOCK_Q + r ... cu_q[r+1] // BLOCK_Q + r
        split = 0
    else:
        row = tl.program_id(2)
        kvh = tl.program_id(1)
        q_tile = pid0 // NUM_SPLITS
        split = pid0 % NUM_SPLITS
        q_start = tl.load(cu_q_ptr + row, cache_modifier=CACHE)
        q_end = tl.load(cu_q_ptr + row + 1, cache_modifier=CACHE)
    n_q = q_end - q_start
    seq_len = tl.load(seq_lens_ptr + row, cache_modifier=CACHE)
    ctx = seq_len - n_q  # position of the row's first query token

    offs_m = tl.arange(0, BLOCK_M)
    q_local = offs_m // G_PAD
    g = offs_m % G_PAD
    q_idx = q_tile * BLOCK_Q + q_local
    row_valid = (q_local < BLOCK_Q) & (q_idx < n_q) & (g < QUERIES_PER_KV)
    head = (kvh * QUERIES_PER_KV + g).to(tl.int64)
    tok = (q_start + q_idx).to(tl.int64)
    q_pos = ctx + q_idx

    offs_d = tl.arange(0, HD_PAD)
    d_mask = offs_d < HEAD_DIM
    offs_d64 = offs_d.to(tl.int64)
    # keys this tile needs: [0, kv_end); this split takes [kv_lo, kv_hi), a multiple of SPLIT_GRAIN keys (its
    # last BLOCK_N tile masked past kv_hi)
    last_q = tl.minimum(q_tile * BLOCK_Q + BLOCK_Q, n_q) - 1
    kv_end = ctx + last_q + 1
    chunk = tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), SPLIT_GRAIN) * SPLIT_GRAIN
    kv_lo = split * chunk
    kv_hi = tl.minimum(kv_lo + chunk, kv_end)
    # splits that hold keys (split 0 always: a pad row's zeros come out of the merge); the rest exit at once,
    # write no partials and do not arrive, so a short context's grid costs little more than unsplit
    num_used = tl.maximum(tl.cdiv(kv_end, tl.maximum(chunk, 1)), 1)
    if NUM_SPLITS > 1:  # noqa: SIM102 (a constexpr branch around a runtime one)
        if split >= num_used:
            return
    bt_row = bt_ptr + row.to(tl.int64) * stride_bt
    kvh64 = kvh.to(tl.int64)
    if PREFETCH_KV:  # the first tile: FIRST_N keys (<= BLOCK_N)
        k0, v0, offs_n0, n_mask0 = _kv_tile(
            kc_ptr, vc_ptr, bt_row, kv_lo, kv_hi, ctx, kvh64, offs_d64, d_mask, stride_kb, stride_ks, stride_kh,
            stride_kd, stride_vb, stride_vs, stride_vh, stride_vd, BLOCK_SIZE, FIRST_N, ROPE, CACHE,
        )  # fmt: skip
    if ROPE:
        cos, sin = _rope_cos_sin(pos_ptr, cs_ptr, q_start, n_q > 0, offs_d64, d_mask, stride_cs, HEAD_DIM, CACHE)
    if PREFETCH_KV:
        pdl_enter(PDL)
    if (q_tile < 0) | (q_tile * BLOCK_Q >= n_q):  # a slot past the row's tiles, or past the last row's (packed)
        return
    q = tl.load(
        q_ptr + tok[:, None] * stride_qn + head[:, None] * stride_qh + offs_d64[None, :] * stride_qd,
        mask=row_valid[:, None] & d_mask[None, :],
        other=0.0,
    )
    if ROPE:  # decode (one query a row): RoPE on q here; the row's new K/V (position ctx) stay in registers
        q, k_new, v_new = _rope_decode(
            q, q_ptr, tok, head, row_valid, offs_d64, d_mask, q_start, kvh, cos, sin, kn_ptr, vn_ptr,
            kc_ptr, vc_ptr, stride_qn, stride_qh, stride_qd, stride_knn, stride_knh, stride_knd,
            stride_vnn, stride_vnh, stride_vnd, HEAD_DIM, INTERP,
        )  # fmt: skip
    if INTERP:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: fully masked rows stay NaN-free
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HD_PAD], tl.float32)
    v_dtype: tl.constexpr = vc_ptr.dtype.element_ty

    # The first tile (FIRST_N keys) apart when it was read before the wait or is smaller than the rest, with
    # or without the read ahead (so that both give the same tiles, and the same sums); an empty split's is
    # all masked: a no-op.
    start0 = kv_lo
    if PREFETCH_KV or FIRST_N < BLOCK_N:
        if not PREFETCH_KV:
            k0, v0, offs_n0, n_mask0 = _kv_tile(
                kc_ptr, vc_ptr, bt_row, kv_lo, kv_hi, ctx, kvh64, offs_d64, d_mask, stride_kb, stride_ks,
                stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd, BLOCK_SIZE, FIRST_N, ROPE, "",
            )  # fmt: skip
        m_i, l_i, acc = _online_softmax_step(
            q, k0, v0, offs_n0, n_mask0, q_pos, m_i, l_i, acc, qk_scale, v_dtype, DOT_PREC, INTERP
        )
        start0 = kv_lo + FIRST_N
    for start in range(start0, kv_hi, BLOCK_N):
        k, v, offs_n, n_mask = _kv_tile(
            kc_ptr, vc_ptr, bt_row, start, kv_hi, ctx, kvh64, offs_d64, d_mask, stride_kb, stride_ks, stride_kh,
            stride_kd, stride_vb, stride_vs, stride_vh, stride_vd, BLOCK_SIZE, BLOCK_N, ROPE, "",
        )  # fmt: skip
        m_i, l_i, acc = _online_softmax_step(
            q, k, v, offs_n, n_mask, q_pos, m_i, l_i, acc, qk_scale, v_dtype, DOT_PREC, INTERP
        )

    if ROPE:  # noqa: SIM102 (a constexpr branch around a runtime one)
        if (kv_lo <= ctx) & (ctx < kv_hi):  # this split holds the new position: one more online-softmax step
            s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1) * qk_scale
            m_new = tl.maximum(m_i, s_new)
            alpha = tl.exp2(m_i - m_new)
            p_new = tl.exp2(s_new - m_new)
            l_i = l_i * alpha + p_new
            p_new = round_f32(p_new, v_dtype, INTERP)  # P is rounded to the KV dtype, as before P@V
            acc = acc * alpha[:, None] + p_new[:, None] * v_new.to(tl.float32)[None, :]
            m_i = m_new
            slot = tl.load(slot_ptr + q_start).to(tl.int64)
            if slot >= 0:  # and stores it (no program of this launch reads it from the cache)
                c_off = (slot // BLOCK_SIZE) * stride_kb + (slot % BLOCK_SIZE) * stride_ks + kvh64 * stride_kh
                tl.store(kc_ptr + c_off + offs_d64 * stride_kd, k_new, mask=d_mask)
                c_off = (slot // BLOCK_SIZE) * stride_vb + (slot % BLOCK_SIZE) * stride_vs + kvh64 * stride_vh
                tl.store(vc_ptr + c_off + offs_d64 * stride_vd, v_new, mask=d_mask)
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    if NUM_SPLITS == 1:
        out_dtype: tl.constexpr = out_ptr.dtype.element_ty
        tl.store(
            out_ptr + tok[:, None] * stride_on + head[:, None] * stride_oh + offs_d64[None, :] * stride_od,
            cast_rne(o, out_dtype, INTERP),
            mask=row_valid[:, None] & d_mask[None, :],
        )
    else:
        # partials: o_part [S, N, H, HEAD_DIM] fp32 (normalised), lse_part [S, N, H] fp32 (log2 units)
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        base = (split.to(tl.int64) * num_tokens + tok) * NUM_HEADS + head
        tl.store(
            o_part_ptr + base[:, None] * HEAD_DIM + offs_d64[None, :], o, mask=row_valid[:, None] & d_mask[None, :]
        )
        tl.store(lse_part_ptr + base, lse, mask=row_valid)
        # The last split of this tile to arrive merges the splits (flash-decoding's second pass) in split
        # order, so the result does not depend on which split came last.
        tl.debug_barrier()  # every thread's partial stores happen before the release below
        tile = (row * tl.num_programs(1) + kvh) * (tl.num_programs(0) // NUM_SPLITS) + q_tile
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == num_used - 1:  # the other used splits' partials are visible (acquire)
            _combine_splits(
                o_part_ptr,
                lse_part_ptr,
                out_ptr,
                num_tokens,
                tok,
                head,
                row_valid,
                offs_d64,
                d_mask,
                stride_on,
                stride_oh,
                stride_od,
                num_used,
                NUM_HEADS,
                HEAD_DIM,
                NUM_SPLITS,
                INTERP,
            )
            tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")  # re-arm


@triton.jit
def _tile_row(cu_q_ptr, t, num_rows, BLOCK_Q: tl.constexpr):
    """The row whose packed q tiles hold tile ``t``: the last r with cu_q[r] // BLOCK_Q + r <= t (binary search).
    NOTE row r has ceil(n_r / BLOCK_Q) tiles and r + 1 starts at least that many, and at least one, later, so the
    starts increase strictly and a grid of num_tokens // BLOCK_Q + R tiles covers every row."""
    lo = 0
    hi = num_rows
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(cu_q_ptr + mid) // BLOCK_Q + mid <= t:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _kv_tile(
    kc_ptr, vc_ptr, bt_row, start, kv_hi, ctx, kvh64, offs_d64, d_mask, stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, ROPE: tl.constexpr,
    CACHE: tl.constexpr,
):  # fmt: skip
    """Cached keys (transposed, [HD_PAD, BLOCK_N]) and values ([BLOCK_N, HD_PAD]) of positions
    [start, start + BLOCK_N) below kv_hi, with the positions and their mask; with ROPE the new position ctx
    is masked out (the cache does not hold it yet)."""
    offs_n = start + tl.arange(0, BLOCK_N)
    n_mask = offs_n < kv_hi
    if ROPE:
        n_mask = n_mask & (offs_n != ctx)
    blk = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_mask, other=0, cache_modifier=CACHE).to(tl.int64)
    in_blk = (offs_n % BLOCK_SIZE).to(tl.int64)
    k_off = blk * stride_kb + in_blk * stride_ks + kvh64 * stride_kh
    v_off = blk * stride_vb + in_blk * stride_vs + kvh64 * stride_vh
    k = tl.load(
        kc_ptr + k_off[None, :] + offs_d64[:, None] * stride_kd,
        mask=d_mask[:, None] & n_mask[None, :],
        other=0.0,
        cache_modifier=CACHE,
    )
    v = tl.load(
        vc_ptr + v_off[:, None] + offs_d64[None, :] * stride_vd,
        mask=n_mask[:, None] & d_mask[None, :],
        other=0.0,
        cache_modifier=CACHE,
    )
    return k, v, offs_n, n_mask


@triton.jit
def _online_softmax_step(
    q, k, v, offs_n, n_mask, q_pos, m_i, l_i, acc, qk_scale, v_dtype: tl.constexpr, DOT_PREC: tl.constexpr,
    INTERP: tl.constexpr,
):  # fmt: skip
    """One tile of flash attention's online softmax (scores in log2 units): the new (m, l, acc)."""
    if INTERP:
        k = k.to(tl.float32)
    s = tl.dot(q, k, input_precision=DOT_PREC) * qk_scale  # [BLOCK_M, BLOCK_N]
    visible = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if INTERP:
        pv = tl.dot(round_f32(p, v_dtype, INTERP), v.to(tl.float32), input_precision=DOT_PREC)
    else:
        pv = tl.dot(p.to(v_dtype), v, input_precision=DOT_PREC)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _combine_splits(
    o_part_ptr, lse_part_ptr, out_ptr, num_tokens, tok, head, row_valid, offs_d64, d_mask,
    stride_on, stride_oh, stride_od, num_used, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    """Merge the partials of one tile's (token, head) rows from its first ``num_used`` splits (the others hold
    no keys and wrote none) by their LSE and store the output."""
    mask = row_valid[:, None] & d_mask[None, :]
    m = tl.full(row_valid.shape, -1.0e30, tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        base = (s * num_tokens + tok) * NUM_HEADS + head
        used = row_valid & (tl.full(row_valid.shape, s, tl.int32) < num_used)
        m = tl.maximum(m, tl.load(lse_part_ptr + base, mask=used, other=float("-inf"), cache_modifier=".cg"))
    # split 0 always holds key 0, which every query sees, so m is finite - except for a pad row with
    # seq_len 0 (no keys at all): then every weight is 0 and the output is 0, as without splits
    den = tl.zeros(row_valid.shape, tl.float32)
    acc = tl.zeros(mask.shape, tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        base = (s * num_tokens + tok) * NUM_HEADS + head
        used = row_valid & (tl.full(row_valid.shape, s, tl.int32) < num_used)
        w = tl.exp2(tl.load(lse_part_ptr + base, mask=used, other=float("-inf"), cache_modifier=".cg") - m)
        den += w
        o = tl.load(
            o_part_ptr + base[:, None] * HEAD_DIM + offs_d64[None, :],
            mask=used[:, None] & d_mask[None, :],
            other=0.0,
            cache_modifier=".cg",
        )
        acc += w[:, None] * o
    res = acc / tl.where(den > 0, den, 1.0)[:, None]
    out_dtype: tl.constexpr = out_ptr.dtype.element_ty
    tl.store(
        out_ptr + tok[:, None] * stride_on + head[:, None] * stride_oh + offs_d64[None, :] * stride_od,
        cast_rne(res, out_dtype, INTERP),
        mask=mask,
    )


@triton.jit
def _rope_cos_sin(
    pos_ptr, cs_ptr, n, has_query, offs_d64, d_mask, stride_cs, HEAD_DIM: tl.constexpr, CACHE: tl.constexpr
):  # fmt: skip
    """The cos and signed sin of decode token n's position, per element of a head (`_rope_decode`'s); a row
    without a query (``has_query`` false) reads no position."""
    HALF: tl.constexpr = HEAD_DIM // 2
    pos = tl.load(pos_ptr + n, mask=has_query, other=0, cache_modifier=CACHE).to(tl.int64)
    lo = offs_d64 < HALF
    i = tl.where(lo, offs_d64, offs_d64 - HALF)  # rotate_half: d pairs with d +- HALF
    cos = tl.load(cs_ptr + pos * stride_cs + i, mask=d_mask, other=0.0, cache_modifier=CACHE)
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + i, mask=d_mask, other=0.0, cache_modifier=CACHE)
    return cos, tl.where(lo, -sin, sin)  # x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin


@triton.jit
def _rope_decode(
    q, q_ptr, tok, head, row_valid, offs_d64, d_mask, n, kvh, cos, sin,
    kn_ptr, vn_ptr, kc_ptr, vc_ptr, stride_qn, stride_qh, stride_qd,
    stride_knn, stride_knh, stride_knd, stride_vnn, stride_vnh, stride_vnd,
    HEAD_DIM: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    """`rope.rope_and_write_kv`'s values for decode token n, bitwise: returns q rotated (the tile's G heads)
    and the token's rotated k and raw v of kv head ``kvh`` as the cache stores them (``cos``, ``sin``: from
    `_rope_cos_sin`). Needs no FP contraction in fp32, as the rope kernels are compiled."""
    HALF: tl.constexpr = HEAD_DIM // 2
    lo = offs_d64 < HALF
    partner = tl.where(lo, offs_d64 + HALF, offs_d64 - HALF)
    q_dt: tl.constexpr = q_ptr.dtype.element_ty
    qmask = row_valid[:, None] & d_mask[None, :]
    xp_ptrs = q_ptr + tok[:, None] * stride_qn + head[:, None] * stride_qh + partner[None, :] * stride_qd
    xp = tl.load(xp_ptrs, mask=qmask, other=0.0).to(tl.float32)
    qc = round_f32(cos, q_dt, INTERP)[None, :]
    qs = round_f32(sin, q_dt, INTERP)[None, :]
    q_rot = cast_rne(round_f32(q.to(tl.float32) * qc, q_dt, INTERP) + round_f32(xp * qs, q_dt, INTERP), q_dt, INTERP)
    k_dt: tl.constexpr = kn_ptr.dtype.element_ty
    kv64 = kvh.to(tl.int64)
    k_src = kn_ptr + n * stride_knn + kv64 * stride_knh
    kx = tl.load(k_src + offs_d64 * stride_knd, mask=d_mask, other=0.0).to(tl.float32)
    kp = tl.load(k_src + partner * stride_knd, mask=d_mask, other=0.0).to(tl.float32)
    kcos = round_f32(cos, k_dt, INTERP)
    ksin = round_f32(sin, k_dt, INTERP)
    k_rot = cast_rne(round_f32(kx * kcos, k_dt, INTERP) + round_f32(kp * ksin, k_dt, INTERP), k_dt, INTERP)
    v = tl.load(vn_ptr + n * stride_vnn + kv64 * stride_vnh + offs_d64 * stride_vnd, mask=d_mask, other=0.0)
    kc_dt: tl.constexpr = kc_ptr.dtype.element_ty
    vc_dt: tl.constexpr = vc_ptr.dtype.element_ty
    if k_dt != kc_dt:
        k_rot = cast_rne(k_rot.to(tl.float32), kc_dt, INTERP)
    if v.dtype != vc_dt:
        v = cast_rne(v.to(tl.float32), vc_dt, INTERP)
    return q_rot, k_rot, v


class AttnConfig(NamedTuple):
    g_pad: int  # query heads a kv head, padded to a power of two
    hd_pad: int  # head_dim padded
    block_q: int  # query tokens a program
    block_m: int  # tile rows (block_q x g_pad)
    block_n: int  # keys a tile
    num_warps: int
    num_stages: int
    split_grain: int  # a KV split's keys are a multiple of this
    first_n: int  # keys of a split's first tile (read ahead of the PDL wait with prefetch_kv)

    def packed_tiles(self, max_seqlen_q: int, num_splits: int) -> bool:
        """Whether a launch packs its rows' q tiles, rows in order and each row's last first
        (`_paged_attn_kernel`'s PACKED_TILES grid): several q tiles a row and no KV splits, that is a prompt
        chunk's launch; decode launches keep theirs."""
        return triton.cdiv(max_seqlen_q, self.block_q) > 1 and num_splits == 1

    def launch_args(self) -> dict[str, int]:
        """`_paged_attn_kernel`'s compile-time arguments this config sets (the rest come from the call's shapes),
        and the launch's warps and stages: the one place a new field is bound, for `_launch` and for the
        ahead-of-time compile check (benchmarks/kernels/aot_check.py)."""
        return dict(
            G_PAD=self.g_pad,
            HD_PAD=self.hd_pad,
            BLOCK_Q=self.block_q,
            BLOCK_M=self.block_m,
            BLOCK_N=self.block_n,
            SPLIT_GRAIN=self.split_grain,
            FIRST_N=self.first_n,
            num_warps=self.num_warps,
            num_stages=self.num_stages,
        )


def _attn_config(
    max_seqlen_q: int, G: int, hd: int, fp32: bool, block_m, block_n, num_warps, num_stages, num_splits: int = 1,
    split_grain: int | None = None, *, rows: int,
) -> AttnConfig:  # fmt: skip
    """Launch config. Defaults checked with ptxas for sm_90 at hd=128 (no register spills): bf16 decode
    16x64 / 4 warps / 3 stages, bf16 prefill 64x64 / 4 warps / 3 stages (the fastest of
    benchmarks/kernels/prefill_attn_sweep.py's grid at 1 x 2,048 and 16 x 128 prompt tokens, and of five on the
    packed grid as a mixed graph launches it; 2 stages below
    64 query rows, as speculation's verify rows); fp32 ("ieee" dots, no tensor cores, register-hungry) decode
    16x64 / 8 warps, prefill 32x64 / 8 warps. A 16-bit decode of ``rows`` rows
    (one query a row) takes 2 stages from 5 rows and 2 warps from 17 (the best measured alone at 8-64 rows;
    5-7 rows follow 8, and the loop at 5 rows was not slower: docs/engine.md).
    A split's keys are a multiple of the split grain: a tile (BLOCK_N keys), except for a 16-bit decode split
    8 or more ways, whose splits take multiples of 32 keys: at short contexts every split then has keys (with
    64, at most four of eight do at 256 positions), while the tiles stay 64 keys. The first tile (the one read
    ahead of the PDL wait, `rope_kv_attention`'s ``prefetch_kv``) takes ``first_n`` keys: one grain where the
    grain is below a tile, so that a short split is one small tile (why: docs/engine.md)."""
    g_pad = next_pow2(G)
    hd_pad = max(16, next_pow2(hd))
    decode = max_seqlen_q == 1
    rows_rule = decode and not fp32
    if block_m is None:
        if decode:
            block_m = 16
        else:
            block_m = max(16, min(32 if fp32 else 64, next_pow2(max_seqlen_q * g_pad)))
    block_m = max(block_m, g_pad, 16)
    block_q = 1 if decode else max(1, block_m // g_pad)
    if block_n is None:
        block_n = 64 if hd_pad <= 128 else 32
    block_n = max(16, block_n)
    if split_grain is None:
        split_grain = 32 if decode and not fp32 and num_splits >= 8 else block_n
    split_grain = max(1, split_grain)
    if num_warps is None:
        num_warps = 8 if (fp32 or block_m >= 128) else (2 if rows_rule and rows > 16 else 4)
    if num_stages is None:
        num_stages = (2 if rows > 4 else 3) if rows_rule else (3 if block_m >= 64 and not fp32 else 2)
    first_n = split_grain if 16 <= split_grain < block_n and split_grain == next_pow2(split_grain) else block_n
    return AttnConfig(g_pad, hd_pad, block_q, block_m, block_n, num_warps, num_stages, split_grain, first_n)


def splits_for(programs: int, sms: int) -> int:
    """Split-KV factor for a decode grid of ``programs`` (rows x kv heads) on ``sms`` SMs: none once the grid
    fills the GPU, 2 ways when it fills more than half of it, else 4 to 8 (16 kv heads on 132 SMs: 8 / 4 / 4 /
    4 / 2 splits at 1 / 2 / 3 / 4 / 5-8 rows, none from 9; why: docs/engine.md)."""
    if programs >= sms:
        return 1
    if programs * 2 > sms:
        return 2
    return max(4, min(8, sms // max(programs, 1)))


def auto_num_splits(num_rows: int, num_kv_heads: int, max_seqlen_q: int, device: torch.device) -> int:
    """Split-K factor chosen from shapes only (CUDA-graph safe): `splits_for` a decode launch on a GPU, else 1."""
    if max_seqlen_q != 1 or device.type != "cuda":
        return 1
    return splits_for(num_rows * num_kv_heads, sm_count(device))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_seqlen_q: int,
    out: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    split_grain: int | None = None,
) -> torch.Tensor:
    """Causal flash attention of ``q [N, H, hd]`` over paged KV; returns ``[N, H, hd]`` in q.dtype
    (written into ``out`` when given; any strides for q and out).

    ``max_seqlen_q`` (host int) must be >= every row's query count; the grid is
    ``(cdiv(max_seqlen_q, BLOCK_Q) * num_splits, num_kv_heads, R)``, or ``((N // BLOCK_Q + R) * num_kv_heads,)``
    for a launch of several q tiles without splits (prompt chunks: every row's tiles packed, rows in order and
    each row's last tiles first), and tiles past a row's end exit at once, so the grid depends on no device data
    (CUDA-graph capturable).
    ``num_splits > 1`` is split-K (flash-decoding): each split handles a slice of the KV range (a multiple of
    ``split_grain`` keys, default `_attn_config`'s), splits past a row's keys exit at once, and the last split
    of a tile to finish merges the used ones by LSE. Default: chosen from the shapes (only for
    ``max_seqlen_q == 1`` on CUDA). fp32 accumulation; for fp32 inputs the dots are IEEE fp32 (no TF32); for
    bf16/fp16 the softmax probabilities are rounded to the KV dtype before the P@V dot (as FlashAttention
    does).

    Pad rows: a row with ``seq_len == 0`` reads no KV and outputs zeros (NaN-free even if its block
    table row is garbage); a row with ``n_r == 0`` writes nothing.
    """
    out = _check_and_out(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, out)
    if q.shape[0] == 0 or seq_lens.shape[0] == 0 or max_seqlen_q <= 0:
        return out
    if not use_triton(_paged_attn_kernel, q, k_cache):
        return paged_attention_ref(
            q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, max_seqlen_q, out=out
        )
    _launch(
        q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, max_seqlen_q, out, None,
        num_splits, block_m, block_n, num_warps, num_stages, split_grain=split_grain,
    )  # fmt: skip
    return out


def rope_kv_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    block_n: int | None = None,
    split_grain: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    prefetch_kv: bool = False,
) -> torch.Tensor:
    """`rope.rope_and_write_kv` then `paged_attention`, for decode (one query token a row) in one launch:
    each program rotates its q heads and the row's new k (``k``, ``v``: ``[N, kvh, hd]``) bitwise as the rope
    kernel does; the split holding the new position adds it to its softmax from registers (one more online
    step after the tiles, which skip it) and writes the rotated k and raw v to the caches at ``slot_mapping``.
    The caches are bitwise those of the two calls, the output equal up to the order of the softmax sums;
    q itself is not rotated in place (nothing reads it after).

    ``prefetch_kv``: the caller promises that the kernel launched just before this one (in the model, the
    qkv projection) writes neither the caches nor ``positions``, ``cos_sin_cache``, ``cu_seqlens_q``,
    ``seq_lens`` or ``block_tables``; each program then reads those (its first tile of cached keys and
    values only) before its programmatic-dependent-launch wait. Same results either way.

    ``num_splits`` (split-KV; default `auto_num_splits`), ``block_n`` (keys a tile), ``split_grain`` (a split's
    keys are a multiple of it), ``num_warps`` and ``num_stages`` override the launch config; the results agree
    up to the order of the softmax sums."""
    out = _check_and_out(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, out)
    N, H, hd = q.shape
    assert cu_seqlens_q.shape[0] == N + 1, "rope_kv_attention is for decode: one query token a row"
    check_rope_args(q, k, positions, cos_sin_cache)
    assert k.shape == v.shape == (N, k_cache.shape[2], hd) and slot_mapping.shape == (N,)
    assert hd == next_pow2(hd), f"head_dim {hd}: the fused RoPE wants a power of two"
    if N == 0:
        return out
    if not use_triton(_paged_attn_kernel, q, k_cache):
        return rope_kv_attention_ref(
            q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, cu_seqlens_q, seq_lens, block_tables,
            scale, out=out,
        )  # fmt: skip
    rope = (positions, cos_sin_cache, k, v, slot_mapping)
    _launch(
        q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, 1, out, rope, num_splits,
        block_n=block_n, num_warps=num_warps, num_stages=num_stages, split_grain=split_grain, prefetch_kv=prefetch_kv,
    )  # fmt: skip
    return out


def _check_and_out(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, out) -> torch.Tensor:
    N, H, hd = q.shape
    assert k_cache.dim() == 4 and v_cache.shape == k_cache.shape, (k_cache.shape, v_cache.shape)
    nb, bs, kvh, hd_k = k_cache.shape
    assert hd_k == hd and H % kvh == 0, (q.shape, k_cache.shape)
    R = seq_lens.shape[0]
    assert cu_seqlens_q.shape == (R + 1,) and block_tables.dim() == 2 and block_tables.shape[0] == R
    if out is None:
        return torch.empty(N, H, hd, dtype=q.dtype, device=q.device)
    assert out.shape == (N, H, hd), (out.shape, q.shape)
    return out


def _launch(
    q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, max_seqlen_q, out, rope,
    num_splits=None, block_m=None, block_n=None, num_warps=None, num_stages=None, prefetch_kv=False,
    split_grain=None,
) -> None:  # fmt: skip
    assert rope is not None or not prefetch_kv, "prefetch_kv is for decode with RoPE (rope_kv_attention)"
    N, H, hd = q.shape
    nb, bs, kvh, _ = k_cache.shape
    R = seq_lens.shape[0]
    G = H // kvh
    fp32 = q.dtype == torch.float32 or k_cache.dtype == torch.float32
    if num_splits is None:
        num_splits = auto_num_splits(R, kvh, max_seqlen_q, q.device)
    num_splits = max(1, int(num_splits))
    cfg = _attn_config(
        max_seqlen_q, G, hd, fp32, block_m, block_n, num_warps, num_stages, num_splits, split_grain, rows=R
    )
    q_tiles = triton.cdiv(max_seqlen_q, cfg.block_q)
    if num_splits > 1:
        o_part = torch.empty(num_splits, N, H, hd, dtype=torch.float32, device=q.device)
        lse_part = torch.empty(num_splits, N, H, dtype=torch.float32, device=q.device)
        count = arrival_counters(q.device, q_tiles * kvh * R)
    else:
        o_part = lse_part = count = out  # unused
    if rope is None:
        pos = cs = kn = vn = slot = q  # unused
        rope_strides = (0,) * 7
    else:
        pos, cs, kn, vn, slot = rope
        rope_strides = (cs.stride(0), *kn.stride(), *vn.stride())
    dot_prec = "ieee" if fp32 else "tf32"  # "tf32" is ignored for 16-bit operands
    packed = cfg.packed_tiles(max_seqlen_q, num_splits)
    grid = ((N // cfg.block_q + R) * kvh, 1, 1) if packed else (q_tiles * num_splits, kvh, R)
    _paged_attn_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        o_part,
        lse_part,
        cu_seqlens_q,
        seq_lens,
        block_tables,
        count,
        pos,
        cs,
        kn,
        vn,
        slot,
        float(scale) * _LOG2E,
        N,
        R,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *out.stride(),
        block_tables.stride(0),
        *rope_strides,
        NUM_HEADS=H,
        QUERIES_PER_KV=G,
        HEAD_DIM=hd,
        BLOCK_SIZE=bs,
        NUM_SPLITS=num_splits,
        ROPE=rope is not None,
        PREFETCH_KV=prefetch_kv,
        DOT_PREC=dot_prec,
        INTERP=kernel_is_interpreted(_paged_attn_kernel),
        PACKED_TILES=packed,
        **cfg.launch_args(),
        enable_fp_fusion=not (fp32 or rope is not None),  # RoPE rounds as the rope kernels (compiled without)
        **pdl_launch(_paged_attn_kernel, q.device),
    )
