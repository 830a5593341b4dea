"""The Ouro model for the engine: weights fused at load, one loop over a flat batch of rows.

The three stages of a round (docs/engine.md) are separate methods so the runner can batch them independently:
`embed` (prelude), `loop` (recurrent core: every layer then `model.norm`), and `gate` / `logits` (exit
check and coda). Memory-bound ops and the projections go through the backend (`backend.linear`: a decode
kernel for few rows, cuBLAS otherwise), with q/k/v and gate/up fused and SiLU-mul folded into the down
projection.

Between the kernels the loop may ask the L2 cache to fetch the weights of the next projections ahead
(`PrefetchPlan`, `backend.prefetch_l2`): for few rows HBM is idle while RoPE, attention and the norms run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

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


# The points of a layer where the loop may prefetch, in order: after each op.
PREFETCH_POINTS = ("qkv", "attention", "o", "norm1", "gate_up", "down", "norm2")


@dataclass(frozen=True)
class PrefetchPlan:
    """Which weights the loop asks L2 to fetch ahead, for loops over at most `max_rows` rows. ``after[point]``
    (a `PREFETCH_POINTS` entry) lists ``(weight, lo, hi, layer_offset)``: rows [lo, hi) (fractions) of that
    `LayerWeights` field of layer ``i + layer_offset``, requested right after that point of layer i. At
    most two ranges a point; ranges past the last layer are dropped."""

    max_rows: int = 0
    after: dict[str, tuple[tuple[str, float, float, int], ...]] = field(default_factory=dict)


NO_PREFETCH = PrefetchPlan()


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
        self.set_prefetch_plan(NO_PREFETCH)

    def set_prefetch_plan(self, plan: PrefetchPlan) -> None:
        """Use `plan` from the next loop on (graphs captured before keep what they captured).
        ``OURO_L2_PREFETCH=0`` turns every plan off (the A/B switch of the benchmarks)."""
        if os.environ.get("OURO_L2_PREFETCH", "1") == "0":
            plan = NO_PREFETCH
        assert set(plan.after) <= set(PREFETCH_POINTS), sorted(plan.after)
        self.prefetch_plan = plan
        L = len(self.layers)
        self._prefetch: list[dict[str, list[torch.Tensor]]] = []
        for i in range(L):
            at: dict[str, list[torch.Tensor]] = {}
            for point, ranges in plan.after.items():
                assert len(ranges) <= 2, (point, ranges)
                views = []
                for name, lo, hi, offset in ranges:
                    if i + offset < L:
                        w = getattr(self.layers[i + offset], name)
                        views.append(w[int(lo * w.shape[0]) : int(hi * w.shape[0])])
                if views:
                    at[point] = views
            self._prefetch.append(at)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens[token_ids]

    def loop(
        self, h: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv_cache: torch.Tensor
    ) -> torch.Tensor:
        """One Ouro loop: every layer in order, then model.norm. Returns the normed state."""
        cfg, ops = self.cfg, self.backend
        eps, n = cfg.rms_norm_eps, h.shape[0]
        plan = self._prefetch if n <= self.prefetch_plan.max_rows else None

        def prefetch(i: int, point: str) -> None:
            if plan is not None and point in plan[i]:
                ops.prefetch_l2(*plan[i][point])

        x = ops.rms_norm(h, self.layers[0].ln_in, eps)
        for i, layer in enumerate(self.layers):
            qkv = ops.linear(x, layer.qkv)
            prefetch(i, "qkv")
            q = qkv[:, : cfg.q_size].view(n, cfg.num_attention_heads, cfg.head_dim)
            k = qkv[:, cfg.q_size : cfg.q_size + cfg.kv_size].view(n, cfg.num_key_value_heads, cfg.head_dim)
            v = qkv[:, cfg.q_size + cfg.kv_size :].view(n, cfg.num_key_value_heads, cfg.head_dim)
            k_cache, v_cache = kv_cache[i, 0], kv_cache[i, 1]
            attn = ops.rope_kv_attention(q, k, v, positions, self.cos_sin, k_cache, v_cache, meta, self.scale)
            prefetch(i, "attention")
            o = ops.linear(attn.view(n, cfg.q_size), layer.o)
            prefetch(i, "o")
            h, x = ops.sandwich_norm(o, h, layer.ln_in2, layer.ln_post, eps)
            prefetch(i, "norm1")
            gu = ops.linear(x, layer.gate_up)
            prefetch(i, "gate_up")
            m = ops.linear(gu, layer.down, silu_x=True)
            prefetch(i, "down")
            next_norm = self.layers[i + 1].ln_in if i + 1 < len(self.layers) else self.norm
            h, x = ops.sandwich_norm(m, h, layer.ln_post2, next_norm, eps)
            prefetch(i, "norm2")
        # x is now model.norm(h): the loop's output, the next loop's input, the gate's and LM head's input.
        return x

    def gate(self, h: torch.Tensor) -> torch.Tensor:
        """Per-row exit probability lambda = sigmoid(gate(h)), fp32 [rows]."""
        return torch.sigmoid(h.float() @ self.gate_w.t() + self.gate_b).squeeze(-1)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return (h @ self.lm_head.t()).float()
