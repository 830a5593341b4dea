"""FlashAttention backend: FlashAttention's paged varlen kernel for attention, our Triton kernels for the rest.

Picked by GPU architecture: FlashAttention-3 (`flash_attn_interface`) on Hopper (sm90), else
FlashAttention-2 (`flash_attn`, sm80+). FA2's paged path needs block_size % 256 == 0. Not on the
benchmark device's image (the flash-attn-4 wheels exceed what a device call can carry), so this path is
checked for a clear error here and left unmeasured; the Triton kernels are the primary path.
"""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F

from ..config import ConfigError
from ..model.attention import AttentionMetadata
from .backend import TritonBackend


def _load_flash(device: torch.device):
    major, _ = torch.cuda.get_device_capability(device) if device.type == "cuda" else (0, 0)
    if major < 8:
        raise ConfigError("attention_backend=flash needs an NVIDIA GPU of compute capability 8.0 or newer")
    candidates = ["flash_attn_interface", "flash_attn"] if major == 9 else ["flash_attn"]
    for name in candidates:
        try:
            return name, importlib.import_module(name)
        except ImportError:
            continue
    raise ConfigError(
        f"attention_backend=flash was asked for but none of {candidates} is installed "
        f"(pip install flash-attn), or use attention_backend=triton"
    )


class FlashBackend(TritonBackend):
    name = "flash"

    def __init__(self, device: torch.device, block_size: int):
        self.module_name, self.fa = _load_flash(device)
        if self.module_name == "flash_attn" and block_size % 256:
            raise ConfigError(
                f"attention_backend=flash with FlashAttention-2 needs block_size to be a multiple "
                f"of 256 (paged KV), got {block_size}"
            )

    def attention(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        cu_k = F.pad(meta.seq_lens.cumsum(0, dtype=torch.int32), (1, 0))
        common = dict(softmax_scale=scale, causal=True)
        if self.module_name == "flash_attn_interface":
            out = self.fa.flash_attn_varlen_func(
                q,
                k_cache,
                v_cache,
                meta.cu_seqlens_q,
                None,
                meta.max_seqlen_q,
                meta.max_seqlen_k,
                seqused_k=meta.seq_lens,
                page_table=meta.block_tables,
                **common,
            )
        else:
            out = self.fa.flash_attn_varlen_func(
                q,
                k_cache,
                v_cache,
                meta.cu_seqlens_q,
                cu_k,
                meta.max_seqlen_q,
                meta.max_seqlen_k,
                block_table=meta.block_tables,
                **common,
            )
        return out[0] if isinstance(out, tuple) else out
