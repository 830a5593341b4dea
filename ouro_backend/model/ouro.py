"""The Ouro model for the engine: weights fused at load, one loop over a flat batch of rows.

The three stages of a round (docs/engine.md) are separate methods so the runner can batch them independently:
`embed` (prelude), `loop` (recurrent core: every layer then `model.norm`), and `gate` / `logits` (exit
check and coda). Memory-bound ops and the projections go through the backend (`backend.linear`: a decode
kernel for few rows, cuBLAS otherwise), with q/k/v and gate/up fused; `backend.mlp` puts SiLU-mul in the
gate/up kernel's epilogue or the down projection's x load.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import OuroConfig
from .attention import AttentionMetadata
from .torch_ops import build_cos_sin_cache


@dataclass
class LayerWeights:
    qkv: torch.Tensor  # [q_size + 2 kv_size, H]
    o: torch.Tensor
    gate_up: torch.Tensor  # [2 I, H]
    down: torch.Tensor
    ln_in: torch.Tensor
    ln_in2: torch.Tensor
    ln_post: torch.Tensor
    ln_post2: torch.Tensor


class OuroModel:
    def __init__(self, cfg: OuroConfig, weights: dict[str, torch.Tensor], backend, max_positions: int):
        self.cfg = cfg
        self.backend = backend
        w = weights
        self.embed_tokens = w["model.embed_tokens.weight"]
        self.layers = []
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            self.layers.append(
                LayerWeights(
                    qkv=torch.cat([w[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]).contiguous(),
                    o=w[p + "self_attn.o_proj.weight"],
                    gate_up=torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]]).contiguous(),
                    down=w[p + "mlp.down_proj.weight"],
                    ln_in=w[p + "input_layernorm.weight"],
                    ln_in2=w[p + "input_layernorm_2.weight"],
                    ln_post=w[p + "post_attention_layernorm.weight"],
                    ln_post2=w[p + "post_attention_layernorm_2.weight"],
                )
            )
        self.norm = w["model.norm.weight"]
        # The exit gate is evaluated in fp32 (docs/model.md).
        self.gate_w = w["model.early_exit_gate.weight"].float()
        self.gate_b = w["model.early_exit_gate.bias"].float()
        self.lm_head = w["lm_head.weight"]
        self.dtype = self.embed_tokens.dtype
        self.device = self.embed_tokens.device
        self.cos_sin = build_cos_sin_cache(max_positions, cfg.head_dim, cfg.rope_theta, self.device)
        self.scale = cfg.head_dim**-0.5

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens[token_ids]

    def loop(
        self, h: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv_cache: torch.Tensor
    ) -> torch.Tensor:
        """One Ouro loop: every layer in order, then model.norm. Returns the normed state."""
        cfg, ops = self.cfg, self.backend
        eps, n = cfg.rms_norm_eps, h.shape[0]
        x = ops.rms_norm(h, self.layers[0].ln_in, eps)
        for i, layer in enumerate(self.layers):
            qkv = ops.linear(x, layer.qkv)
            q = qkv[:, : cfg.q_size].view(n, cfg.num_attention_heads, cfg.head_dim)
            k = qkv[:, cfg.q_size : cfg.q_size + cfg.kv_size].view(n, cfg.num_key_value_heads, cfg.head_dim)
            v = qkv[:, cfg.q_size + cfg.kv_size :].view(n, cfg.num_key_value_heads, cfg.head_dim)
            k_cache, v_cache = kv_cache[i, 0], kv_cache[i, 1]
            attn = ops.rope_kv_attention(q, k, v, positions, self.cos_sin, k_cache, v_cache, meta, self.scale)
            o = ops.linear(attn.view(n, cfg.q_size), layer.o, next_weight=layer.gate_up)
            h, x = ops.sandwich_norm(o, h, layer.ln_in2, layer.ln_post, eps)
            m = ops.mlp(x, layer.gate_up, layer.down)
            next_norm = self.layers[i + 1].ln_in if i + 1 < len(self.layers) else self.norm
            h, x = ops.sandwich_norm(m, h, layer.ln_post2, next_norm, eps)
        # x is now model.norm(h): the loop's output, the next loop's input, the gate's and LM head's input.
        return x

    def gate(self, h: torch.Tensor) -> torch.Tensor:
        """Per-row exit probability lambda = sigmoid(gate(h)), fp32 [rows]."""
        return torch.sigmoid(h.float() @ self.gate_w.t() + self.gate_b).squeeze(-1)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return (h @ self.lm_head.t()).float()
