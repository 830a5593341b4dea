"""Triton kernels for the GPU attention backend, each with a plain-torch ``*_ref`` twin (the twins live in
``ouro_backend/model/torch_ops.py``, which is also the CPU path).

On CUDA tensors the Triton kernels run; under ``TRITON_INTERPRET=1`` (set before importing this package)
they run in Triton's CPU interpreter; on CPU tensors otherwise the torch references are used.
"""

from ..model.torch_ops import build_cos_sin_cache, rope_kv_attention_ref
from . import coda, decode_step
from .activation import silu_mul, silu_mul_ref
from .attention import (
    auto_num_splits,
    copy_kv_slots,
    copy_kv_slots_ref,
    paged_attention,
    paged_attention_ref,
    rope_kv_attention,
    write_kv,
    write_kv_ref,
)
from .norm import rms_norm, rms_norm_ref, sandwich_norm, sandwich_norm_ref
from .projections import LinearConfig, config_for, linear, linear_ref, mlp, mlp_ref
from .rope import rope_, rope_and_write_kv, rope_and_write_kv_ref, rope_ref

__all__ = [
    "auto_num_splits",
    "build_cos_sin_cache",
    "copy_kv_slots",
    "copy_kv_slots_ref",
    "coda",
    "config_for",
    "decode_step",
    "linear",
    "linear_ref",
    "LinearConfig",
    "mlp",
    "mlp_ref",
    "paged_attention",
    "paged_attention_ref",
    "rms_norm",
    "rms_norm_ref",
    "rope_",
    "rope_and_write_kv",
    "rope_and_write_kv_ref",
    "rope_kv_attention",
    "rope_kv_attention_ref",
    "rope_ref",
    "sandwich_norm",
    "sandwich_norm_ref",
    "silu_mul",
    "silu_mul_ref",
    "write_kv",
    "write_kv_ref",
]
