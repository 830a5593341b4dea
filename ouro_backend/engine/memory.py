"""Automatic KV sizing on CUDA (docs/model.md): profile a peak round, give the rest to the KV cache."""

from __future__ import annotations

import logging

import torch

from ..config import ConfigError
from ..model.attention import AttentionMetadata

log = logging.getLogger(__name__)
RESERVE_BYTES = 1 << 30  # CUDA graph pools, cuBLAS workspaces, fragmentation


@torch.inference_mode()
def profile_kv_budget(engine) -> int:
    """Bytes for the KV cache: utilization * total, minus memory other than ours, weights, the measured
    peak activation of the largest round, and a reserve. Allocator-cached free memory counts as free."""
    cfg, model, dev = engine.config, engine.model, engine.device
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    weights = torch.cuda.memory_allocated(dev)
    n = cfg.max_num_batched_tokens
    bs = cfg.block_size
    blocks = -(-n // bs)
    m = engine.model_config
    scratch = torch.empty(
        m.num_hidden_layers, 2, blocks, bs, m.num_key_value_heads, m.head_dim, dtype=engine.dtype, device=dev
    )
    meta = AttentionMetadata(
        cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=dev),
        block_tables=torch.arange(blocks, dtype=torch.int32, device=dev)[None],
        slot_mapping=torch.arange(n, dtype=torch.int64, device=dev),
        max_seqlen_q=n,
        max_seqlen_k=n,
        cu_seqlens_q_host=[0, n],
        seq_lens_host=[n],
    )
    h = model.embed(torch.zeros(n, dtype=torch.long, device=dev))
    out = model.loop(h, torch.arange(n, device=dev), meta, scratch)
    model.logits(out[: cfg.max_num_seqs])
    torch.cuda.synchronize(dev)
    activation = torch.cuda.max_memory_allocated(dev) - weights - scratch.numel() * scratch.element_size()
    del scratch, h, out
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(dev)
    others = total - free - torch.cuda.memory_reserved(dev)  # CUDA context and other processes
    budget = int(total * cfg.gpu_memory_utilization - others - weights - activation - RESERVE_BYTES)
    log.info(
        "KV sizing: total %.1f GiB x %.2f, others %.2f GiB, weights %.2f GiB, peak activation %.2f GiB, "
        "reserve %.2f GiB -> KV %.2f GiB",
        total / 2**30,
        cfg.gpu_memory_utilization,
        others / 2**30,
        weights / 2**30,
        activation / 2**30,
        RESERVE_BYTES / 2**30,
        budget / 2**30,
    )
    if budget <= 0:
        raise ConfigError(
            f"no GPU memory left for the KV cache (budget {budget / 2**30:.2f} GiB); raise "
            f"gpu_memory_utilization or lower max_num_batched_tokens"
        )
    return budget
