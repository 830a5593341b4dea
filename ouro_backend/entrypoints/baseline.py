"""The baseline every benchmark is compared with: what a user runs today without this project.

HF-style eager generation: a static batch, full depth (all T loops per token), one KV tensor per
(loop, layer) grown with torch.cat every step, SDPA attention, unfused weights, no graphs. Same math as
the oracle (its reference RMSNorm and RoPE), batched and cached.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from ..config import OuroConfig
from ..model.oracle import rms_norm_ref, rope_ref


class EagerBaseline:
    def __init__(self, cfg: OuroConfig, weights: dict[str, torch.Tensor]):
        self.cfg, self.w = cfg, weights

    def _forward(self, ids: torch.Tensor, start: int, cache: list) -> torch.Tensor:
        cfg, w = self.cfg, self.w
        B, S = ids.shape
        hd, eps = cfg.head_dim, cfg.rms_norm_eps
        pos = torch.arange(start, start + S, device=ids.device)
        h = w["model.embed_tokens.weight"][ids]
        for d in range(cfg.total_ut_steps):
            for l in range(cfg.num_hidden_layers):
                p = f"model.layers.{l}."
                x = rms_norm_ref(h, w[p + "input_layernorm.weight"], eps)
                q = (x @ w[p + "self_attn.q_proj.weight"].t()).view(B * S, -1, hd)
                k = (x @ w[p + "self_attn.k_proj.weight"].t()).view(B * S, -1, hd)
                v = (x @ w[p + "self_attn.v_proj.weight"].t()).view(B, S, -1, hd).transpose(1, 2)
                q = rope_ref(q, pos.repeat(B), cfg).view(B, S, -1, hd).transpose(1, 2)
                k = rope_ref(k, pos.repeat(B), cfg).view(B, S, -1, hd).transpose(1, 2)
                slot = d * cfg.num_hidden_layers + l  # HF's cache index for (loop, layer)
                if cache[slot] is not None:
                    k = torch.cat([cache[slot][0], k], dim=2)
                    v = torch.cat([cache[slot][1], v], dim=2)
                cache[slot] = (k, v)
                a = F.scaled_dot_product_attention(q, k, v, is_causal=S > 1, enable_gqa=True)
                o = a.transpose(1, 2).reshape(B, S, -1) @ w[p + "self_attn.o_proj.weight"].t()
                h = h + rms_norm_ref(o, w[p + "input_layernorm_2.weight"], eps)
                x = rms_norm_ref(h, w[p + "post_attention_layernorm.weight"], eps)
                m = (F.silu(x @ w[p + "mlp.gate_proj.weight"].t()) * (x @ w[p + "mlp.up_proj.weight"].t())) @ w[
                    p + "mlp.down_proj.weight"
                ].t()
                h = h + rms_norm_ref(m, w[p + "post_attention_layernorm_2.weight"], eps)
            h = rms_norm_ref(h, w["model.norm.weight"], eps)
        return (h[:, -1] @ w["lm_head.weight"].t()).float()

    @torch.inference_mode()
    def generate(self, ids: torch.Tensor, max_new_tokens: int) -> dict:
        """Greedy; returns tokens and timings (prefill seconds, decode seconds)."""
        cache: list = [None] * (self.cfg.total_ut_steps * self.cfg.num_hidden_layers)
        sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
        sync()
        t0 = time.perf_counter()
        nxt = self._forward(ids, 0, cache).argmax(-1, keepdim=True)
        sync()
        t1 = time.perf_counter()
        out = [nxt]
        for i in range(max_new_tokens - 1):
            nxt = self._forward(nxt, ids.shape[1] + i, cache).argmax(-1, keepdim=True)
            out.append(nxt)
        sync()
        t2 = time.perf_counter()
        return dict(tokens=torch.cat(out, 1).tolist(), prefill_s=t1 - t0, decode_s=t2 - t1)
