"""A trainable Ouro: the architecture of docs/model.md as a batched torch module whose parameter names are the
HF checkpoint's, so `state_dict()` is a checkpoint our loader reads; and the Ouro exit-gate objective.

Every token runs all T loops during training (the KV each loop attends to is that loop's own, as in the
engine's prefill). Loop t's normed state gives loop t's logits (shared LM head) and its exit gate
lambda_t = sigmoid(gate(state_t)); the next loop starts from that normed state.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..config import OuroConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, init: float = 1.0):
        super().__init__()
        self.weight = nn.Parameter(torch.full((dim,), init))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def _linear(n_in: int, n_out: int) -> nn.Linear:
    lin = nn.Linear(n_in, n_out, bias=False)
    nn.init.normal_(lin.weight, std=n_in**-0.5)
    return lin


class Attention(nn.Module):
    def __init__(self, cfg: OuroConfig):
        super().__init__()
        H, hd = cfg.hidden_size, cfg.head_dim
        self.q_proj, self.k_proj = _linear(H, cfg.q_size), _linear(H, cfg.kv_size)
        self.v_proj, self.o_proj = _linear(H, cfg.kv_size), _linear(cfg.q_size, H)
        self.heads, self.kv_heads, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, hd

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, self.heads, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, S, self.kv_heads, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, S, self.kv_heads, self.hd).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.heads != self.kv_heads)
        return self.o_proj(o.transpose(1, 2).reshape(B, S, -1))


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (docs/model.md); cos/sin [S, head_dim] with the half-angles repeated."""
    half = x.shape[-1] // 2
    return x * cos.to(x.dtype) + torch.cat([-x[..., half:], x[..., :half]], -1) * sin.to(x.dtype)


class Layer(nn.Module):
    def __init__(self, cfg: OuroConfig, sandwich_init: float):
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = Attention(cfg)
        self.mlp = nn.Module()
        self.mlp.gate_proj, self.mlp.up_proj = _linear(H, cfg.intermediate_size), _linear(H, cfg.intermediate_size)
        self.mlp.down_proj = _linear(cfg.intermediate_size, H)
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(H, eps), RMSNorm(H, eps)
        # Sandwich norms scale each sublayer's update to the residual: small at first, so the 2 L T updates of
        # a token refine its state instead of washing its identity out.
        self.input_layernorm_2 = RMSNorm(H, eps, sandwich_init)
        self.post_attention_layernorm_2 = RMSNorm(H, eps, sandwich_init)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dropout: float) -> torch.Tensor:
        a = self.self_attn(self.input_layernorm(h), cos, sin)
        h = h + F.dropout(self.input_layernorm_2(a), dropout, self.training)
        x = self.post_attention_layernorm(h)
        m = self.mlp.down_proj(F.silu(self.mlp.gate_proj(x)) * self.mlp.up_proj(x))
        return h + F.dropout(self.post_attention_layernorm_2(m), dropout, self.training)


class LoopedLM(nn.Module):
    def __init__(self, cfg: OuroConfig, dropout: float = 0.0, sandwich_init: float = 0.2):
        super().__init__()
        self.cfg, self.dropout = cfg, dropout
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        nn.init.normal_(self.model.embed_tokens.weight, std=1.0)
        self.model.layers = nn.ModuleList(Layer(cfg, sandwich_init) for _ in range(cfg.num_hidden_layers))
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.model.early_exit_gate = nn.Linear(cfg.hidden_size, 1)
        nn.init.zeros_(self.model.early_exit_gate.weight)
        nn.init.zeros_(self.model.early_exit_gate.bias)
        self.lm_head = _linear(cfg.hidden_size, cfg.vocab_size)
        self.lm_head.weight.data.mul_(0.5)
        hd = cfg.head_dim
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2).float() / hd))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, ids: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """ids [B, S] -> (per-loop normed states [B, S, H] x T, gate logits [T, B, S] in fp32: lambda_t is
        their sigmoid)."""
        S = ids.shape[1]
        freqs = torch.arange(S, device=ids.device).float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], -1)
        cos, sin = emb.cos(), emb.sin()
        h = self.model.embed_tokens(ids)
        states, gates = [], []
        for _ in range(self.cfg.total_ut_steps):
            for layer in self.model.layers:
                h = layer(h, cos, sin, self.dropout)
            h = self.model.norm(h)
            states.append(h)
            gate = self.model.early_exit_gate
            with torch.autocast(h.device.type, enabled=False):  # fp32, as the engine evaluates it
                gates.append(F.linear(h.float(), gate.weight.float(), gate.bias.float()).squeeze(-1))
        return states, torch.stack(gates)

    def export_state(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The HF-named checkpoint tensors, contiguous, in `dtype` (the gate as a [1, H] weight, [1] bias)."""
        return {k: v.detach().to("cpu", dtype).contiguous() for k, v in self.state_dict().items()}


def exit_distribution(gate_logits: torch.Tensor) -> torch.Tensor:
    """Gate logits [T, ...] -> p(exit at loop t) [T, ...]: lambda_t prod_{j<t}(1 - lambda_j) for t < T, and the
    rest of the mass at T (the engine's `remaining`, docs/model.md). In log space: a saturated gate
    (lambda = 1 in floating point) must not zero the product and its gradient."""
    T = gate_logits.shape[0]
    log_stay = F.logsigmoid(-gate_logits)  # log(1 - lambda)
    log_survive = torch.cat([torch.zeros_like(log_stay[:1]), torch.cumsum(log_stay[:-1], 0)])  # sum_{j<t}
    log_p = torch.cat([log_survive[: T - 1] + F.logsigmoid(gate_logits[: T - 1]), log_survive[T - 1 :]])
    return log_p.exp()


def ouro_loss(model: LoopedLM, ids: torch.Tensor, entropy_weight: float) -> tuple[torch.Tensor, dict]:
    """The Ouro objective on next-token prediction: sum_t p(t) CE_t - beta H(p), averaged over tokens.
    Returns (loss, stats) with each loop's mean CE and the mean exit distribution."""
    states, gate_logits = model(ids[:, :-1])
    target = ids[:, 1:]
    ce = torch.stack(
        [
            F.cross_entropy(model.lm_head(s).float().flatten(0, 1), target.flatten(), reduction="none").view_as(target)
            for s in states
        ]
    )  # [T, B, S]
    p = exit_distribution(gate_logits)
    entropy = -(p * torch.log(p.clamp_min(1e-12))).sum(0)
    loss = ((p * ce).sum(0) - entropy_weight * entropy).mean()
    ce, p, entropy = ce.detach(), p.detach(), entropy.detach()
    stats = dict(
        loss=float(loss.detach()),
        ce_per_loop=[float(x) for x in ce.mean((1, 2))],
        expected_ce=float((p * ce).sum(0).mean()),
        exit_dist=[float(x) for x in p.mean((1, 2))],
        entropy=float(entropy.mean()),
        entropy_max=math.log(p.shape[0]),
    )
    return loss, stats
