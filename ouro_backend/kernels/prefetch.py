"""Ask the L2 cache to fetch weights ahead of the kernels that will stream them (sm90 bulk prefetch).

At decode time HBM sits idle while latency-bound kernels run (RoPE + KV write, attention with few rows, the
norms) and in every projection's ramp and tail. `prefetch_l2` is a kernel placed in that gap: each program
issues ``cp.async.bulk.prefetch.L2`` for its share of up to two byte ranges (weights the next projections
read) and exits; the fetch proceeds in the background, and the projection later finds those bytes in L2.

It changes no data, so its torch twin is nothing at all. It only pays with programmatic dependent launch
(`_common.pdl_launch`): launched with it, the kernel starts when the kernel before it starts, lets the next
kernel launch at once, issues its prefetches, and then waits for the kernel before it to finish. NOTE that
wait is what keeps the stream ordered: the next kernel's `pdl_enter` waits only for this kernel, so this
kernel must not finish before the one before it. Without PDL it would only add a launch: it does nothing.

Under ``TRITON_INTERPRET=1`` the kernel records the pieces it would issue (``RECORD``) instead of issuing them,
which is how the CPU tests check that the pieces cover every byte once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import gdc_launch_dependents, gdc_wait, kernel_is_interpreted, pdl_enabled, sm_count

PIECE = 32768  # bytes per prefetch instruction (a multiple of 16)
ALIGN = 16  # cp.async.bulk wants 16-byte aligned addresses and sizes


@triton.jit
def _bulk_prefetch_l2(addr, nbytes):
    # One thread of the program issues it: the scalars are computed by every thread alike.
    tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r",
        [addr, nbytes],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _prefetch_range(addr, nbytes, rec_ptr, rec_stride, slot, PIECE: tl.constexpr, RECORD: tl.constexpr):
    """This program's share of [addr, addr + nbytes): whole 16-byte units, in pieces of at most PIECE."""
    pid = tl.program_id(0)
    share = tl.cdiv(tl.cdiv(nbytes, tl.num_programs(0)), 16) * 16
    lo = pid * share
    hi = tl.minimum(lo + share, nbytes)
    for off in range(lo, hi, PIECE):
        size = tl.minimum(hi - off, PIECE)
        if RECORD:  # [program, region slot, piece] -> (offset, size)
            base = ((pid * 2 + slot) * rec_stride + (off - lo) // PIECE) * 2
            tl.store(rec_ptr + base, off)
            tl.store(rec_ptr + base + 1, size)
        else:
            _bulk_prefetch_l2(addr + off, size.to(tl.int32))


@triton.jit(do_not_specialize=["addr0", "bytes0", "addr1", "bytes1"])
def _prefetch_l2_kernel(addr0, bytes0, addr1, bytes1, rec_ptr, rec_stride, PIECE: tl.constexpr, RECORD: tl.constexpr):
    if not RECORD:
        gdc_launch_dependents()  # the next kernel may launch now; its own wait covers this kernel
    _prefetch_range(addr0, bytes0, rec_ptr, rec_stride, 0, PIECE, RECORD)
    _prefetch_range(addr1, bytes1, rec_ptr, rec_stride, 1, PIECE, RECORD)
    if not RECORD:
        gdc_wait()  # finish only after the kernel before this one (module NOTE)


def byte_range(t: torch.Tensor) -> tuple[int, int]:
    """(address, bytes) of a contiguous tensor's storage, cut to whole 16-byte units; (0, 0) if it is not
    contiguous or is empty."""
    if t.numel() == 0 or not t.is_contiguous():
        return 0, 0
    addr = t.data_ptr()
    start = -(-addr // ALIGN) * ALIGN
    end = (addr + t.numel() * t.element_size()) // ALIGN * ALIGN
    return (start, end - start) if end > start else (0, 0)


def prefetch_l2(*tensors: torch.Tensor) -> None:
    """Prefetch up to two contiguous tensors (weights, or slices of them) into L2, in the background. Does
    nothing without PDL (see the module docstring) or off CUDA."""
    assert len(tensors) <= 2, len(tensors)
    if not tensors or not tensors[0].is_cuda or kernel_is_interpreted(_prefetch_l2_kernel):
        return
    dev = tensors[0].device
    if not pdl_enabled(dev):
        return
    (a0, n0), (a1, n1) = [byte_range(t) for t in tensors] + [(0, 0)] * (2 - len(tensors))
    if n0 + n1 == 0:
        return
    _prefetch_l2_kernel[(sm_count(dev),)](
        a0, n0, a1, n1, tensors[0], 0, PIECE=PIECE, RECORD=False, num_warps=1, launch_pdl=True
    )


def record_pieces(sizes: tuple[int, int], programs: int, piece: int = PIECE) -> list[list[tuple[int, int]]]:
    """The pieces (offset, size) `programs` programs would issue for two ranges of ``sizes`` bytes (in the
    interpreter: the kernel's own arithmetic), one list per range. For tests."""
    assert kernel_is_interpreted(_prefetch_l2_kernel), "set TRITON_INTERPRET=1 before importing the kernels"
    per = max(sizes) // programs // piece + 2  # pieces a program issues per range, at most
    rec = torch.full((programs, 2, per, 2), -1, dtype=torch.int64)
    _prefetch_l2_kernel[(programs,)](0, sizes[0], 0, sizes[1], rec, per, PIECE=piece, RECORD=True)
    out: list[list[tuple[int, int]]] = [[], []]
    for p in range(programs):
        for s in range(2):
            out[s] += [(int(o), int(n)) for o, n in rec[p, s].tolist() if n >= 0]
    return out
