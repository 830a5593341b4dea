"""Shared helpers for the Triton kernels: dispatch (GPU / interpreter / torch fallback) and exact
dtype rounding that behaves the same on the GPU and under ``TRITON_INTERPRET=1``.

Why the rounding helpers exist: Triton's CPU interpreter (3.x) converts fp32 -> bf16 by *truncation*
(and computes ``tl.dot`` on bf16 operands on their raw uint16 storage). On the GPU a ``.to(tl.bfloat16)``
is round-to-nearest-even, like torch. To test the exact rounding semantics on the CPU the kernels take an
``INTERP`` constexpr: when set, bf16 rounding is done with integer bit arithmetic (RNE, exact for all
finite values) and dots run on fp32 copies of the operands. On the GPU (``INTERP=False``) the native casts
and bf16 tensor-core dots are used; the code paths differ only in those two places.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

try:  # the class a @triton.jit decorator returns when TRITON_INTERPRET=1 was set at import time
    from triton.runtime.interpreter import InterpretedFunction as _InterpretedFunction
except Exception:  # pragma: no cover - very old / very new Triton
    _InterpretedFunction = None


def kernel_is_interpreted(kernel) -> bool:
    """True when ``kernel`` (a @triton.jit object) runs in the CPU interpreter."""
    return _InterpretedFunction is not None and isinstance(kernel, _InterpretedFunction)


def use_triton(kernel, *tensors: torch.Tensor) -> bool:
    """Run the Triton kernel (CUDA tensors, or any tensors under the interpreter); otherwise the caller
    falls back to its torch reference (CPU tensors without TRITON_INTERPRET)."""
    if kernel_is_interpreted(kernel):
        return True
    return all(t.is_cuda for t in tensors)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else triton.next_power_of_2(int(n))


_SM_COUNT: dict = {}


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached); 1 elsewhere."""
    if device.type != "cuda":
        return 1
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


_COUNTERS: dict[tuple, list[torch.Tensor]] = {}


def arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    """At least ``n`` zeroed int32 arrival counters of this device and stream, for kernels whose last
    program to finish a tile does the tile's final step (split-K sums, split-KV combines). NOTE the
    contract: such a kernel touches them only after `pdl_enter` and leaves every counter it used at 0, so
    the kernels of a stream share one buffer. Old buffers are kept alive: a captured CUDA graph may still
    point at them."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    bufs = _COUNTERS.setdefault(key, [])
    if not bufs or bufs[-1].numel() < n:
        bufs.append(torch.zeros(max(n, 4096), dtype=torch.int32, device=device))
    return bufs[-1]


@triton.jit
def round_f32(x, DTYPE: tl.constexpr, INTERP: tl.constexpr):
    """fp32 ``x`` -> fp32 tensor holding ``x`` rounded (RNE) to DTYPE (identity for fp32)."""
    if tl.float32 == DTYPE:
        y = x
    elif tl.bfloat16 == DTYPE:
        if INTERP:
            bits = x.to(tl.uint32, bitcast=True)
            bits = bits + (((bits >> 16) & 1) + 0x7FFF)
            bits = (bits >> 16) << 16
            y = bits.to(tl.float32, bitcast=True)
        else:
            y = x.to(tl.bfloat16).to(tl.float32)
    else:
        y = x.to(DTYPE).to(tl.float32)
    return y


@triton.jit
def cast_rne(x, DTYPE: tl.constexpr, INTERP: tl.constexpr):
    """fp32 ``x`` -> DTYPE with round-to-nearest-even (also under the interpreter)."""
    if tl.float32 == DTYPE:
        y = x
    elif INTERP:
        # the value is exactly representable after round_f32, so the interpreter's truncating cast is exact
        y = round_f32(x, DTYPE, INTERP).to(DTYPE)
    else:
        y = x.to(DTYPE)
    return y


# Programmatic dependent launch (PDL, sm90+): a kernel launched with it may start while the kernel before it
# on the stream is still running, so its launch and prologue (and, in `linear`, its first weight reads) hide
# under the previous kernel's tail. NOTE the contract every PDL kernel keeps: it calls `pdl_enter` (which
# waits for the previous kernel to finish and its writes to be visible) before it reads anything the
# previous kernel wrote or writes anything another kernel reads, in every program, before any early
# return. What may be read before it: read-only data (weights), and data the previous kernel does not write.
# A kernel starts only once the previous one has passed its own `pdl_enter` (or, launched without PDL, has
# started), so every kernel before that one has finished; such reads bypass L1 (``cache_modifier=".cg"``).
# (That assumes every kernel launched with PDL waits before it lets the next one start, as `pdl_enter` does.)
# Only the caller knows which kernel runs just before, so a kernel reads more than weights early only when
# its caller says so (`attention.rope_kv_attention`'s ``prefetch_kv``). Kernels launched without PDL are
# ordered as usual.
try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except Exception:  # pragma: no cover - a Triton without grid dependency control
    gdc_launch_dependents = gdc_wait = None

_PDL: dict = {}


def pdl_enabled(device: torch.device) -> bool:
    """PDL on this device: a CUDA device of compute capability 9.0 or newer, a Triton that has grid
    dependency control, and ``OURO_PDL`` not set to ``0`` (the switch for A/B runs)."""
    if device.type != "cuda" or gdc_wait is None or os.environ.get("OURO_PDL", "1") == "0":
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _PDL:
        _PDL[idx] = torch.cuda.get_device_capability(idx)[0] >= 9
    return _PDL[idx]


def pdl_launch(kernel, device: torch.device) -> dict:
    """The launch options of a PDL-aware kernel: ``PDL`` (its constexpr) and Triton's ``launch_pdl``."""
    if kernel_is_interpreted(kernel) or not pdl_enabled(device):
        return {"PDL": False}
    return {"PDL": True, "launch_pdl": True}


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """Wait for the previous kernel (its writes visible) and let the next one launch (see `pdl_launch`)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
