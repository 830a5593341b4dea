"""Dense functional oracle: no cache, no batching, no fused weights.

Recomputes everything from the token list, keeping every (token, loop, layer) K/V and selecting the
version each query may see by the KV-layout rule of docs/model.md. Written independently of
`model.py` (HF weight names, unfused projections, its own attention) so the engine is checked against
the math, not against itself.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..config import KVLayout, OuroConfig


@dataclass
class OracleResult:
    hidden: list[list[torch.Tensor]] = field(default_factory=list)  # [token][loop-1]: normed state [H]
    gates: list[list[float]] = field(default_factory=list)  # [token][loop-1]: lambda
    logits: list[torch.Tensor] = field(default_factory=list)  # [token]: logits at the token's exit loop


def rms_norm_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope_ref(x: torch.Tensor, pos: torch.Tensor, cfg: OuroConfig) -> torch.Tensor:
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, device=x.device).float() / cfg.head_dim))
    freqs = pos.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos().to(x.dtype)[:, None, :], emb.sin().to(x.dtype)[:, None, :]
    x1, x2 = x[..., : cfg.head_dim // 2], x[..., cfg.head_dim // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def penalize_ref(
    logits: torch.Tensor, prompt: list[int], output: list[int], penalties: tuple[float, float, float]
) -> torch.Tensor:
    """vLLM's repetition, presence and frequency penalties on one token's fp32 logits [V], token by token:
    a token seen in the prompt or the output has its logit divided by the repetition penalty if positive,
    else multiplied; then each output token loses frequency x its count, and presence once. The penalty
    values are rounded to fp32, as requests' are."""
    rep, pres, freq = (torch.tensor(v, dtype=torch.float32) for v in penalties)
    x = logits.float().clone()
    for t in set(prompt) | set(output):
        x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
    for t, n in Counter(output).items():
        x[t] = x[t] - freq * n
        x[t] = x[t] - pres
    return x


def mask_bad_words_ref(logits: torch.Tensor, output: list[int], bad_words: list[list[int]]) -> torch.Tensor:
    """vLLM's bad words on one token's logits [V], word by word: a word's last token is masked when the
    output ends with the rest of the word (always, for a one-token word)."""
    x = logits.clone()
    for word in bad_words:
        head = word[:-1]
        if not head or output[len(output) - len(head) :] == head:
            x[word[-1]] = float("-inf")
    return x


class DenseOracle:
    def __init__(self, cfg: OuroConfig, weights: dict[str, torch.Tensor]):
        self.cfg = cfg
        self.w = weights

    def forward(
        self, tokens: list[int], num_prompt: int, loops: list[int], layout: KVLayout | str = KVLayout.LAST_EXITED
    ) -> OracleResult:
        """Run `tokens`; token i runs `loops[i]` loops (prompt tokens: all T).

        Token i's logits are taken at its last loop, i.e. they predict token i+1.
        """
        cfg, w = self.cfg, self.w
        layout = KVLayout(layout)
        T, L = cfg.total_ut_steps, cfg.num_hidden_layers
        assert len(loops) == len(tokens) and all(d == T for d in loops[:num_prompt])
        # kv[j][d][l] = (k, v) of token j at loop d (0-based), layer l, after RoPE.
        kv: list[list[list[tuple[torch.Tensor, torch.Tensor]]]] = [[[None] * L for _ in range(T)] for _ in tokens]
        res = OracleResult()
        # Token-major: when token i runs, every earlier token has run all its loops, which covers both
        # rules (a query needs earlier tokens' KV at loop min(d, e_j) or at e_j).
        for i, tok in enumerate(tokens):
            h = w["model.embed_tokens.weight"][tok][None]
            hid, gates = [], []
            for d in range(loops[i]):
                for l in range(L):
                    h = self._layer(h, i, d, l, kv, num_prompt, loops, layout)
                h = rms_norm_ref(h, w["model.norm.weight"], cfg.rms_norm_eps)
                hid.append(h[0])
                gate = torch.sigmoid(
                    h.float() @ w["model.early_exit_gate.weight"].float().t() + w["model.early_exit_gate.bias"].float()
                )
                gates.append(float(gate))
            res.hidden.append(hid)
            res.gates.append(gates)
            res.logits.append((h @ w["lm_head.weight"].t()).float()[0])
        return res

    def _layer(self, h, i, d, l, kv, num_prompt, loops, layout):
        cfg, p = self.cfg, f"model.layers.{l}."
        w = self.w
        eps, hd = cfg.rms_norm_eps, cfg.head_dim
        x = rms_norm_ref(h, w[p + "input_layernorm.weight"], eps)
        q = (x @ w[p + "self_attn.q_proj.weight"].t()).view(1, cfg.num_attention_heads, hd)
        k = (x @ w[p + "self_attn.k_proj.weight"].t()).view(1, cfg.num_key_value_heads, hd)
        v = (x @ w[p + "self_attn.v_proj.weight"].t()).view(1, cfg.num_key_value_heads, hd)
        pos = torch.tensor([i])
        q, k = rope_ref(q, pos, cfg), rope_ref(k, pos, cfg)
        kv[i][d][l] = (k[0], v[0])
        keys, values = [], []
        for j in range(i + 1):
            dj = d if j == i else self._version(j, d, i, num_prompt, loops, layout)
            keys.append(kv[j][dj][l][0])
            values.append(kv[j][dj][l][1])
        K = torch.stack(keys).float().repeat_interleave(cfg.num_attention_heads // cfg.num_key_value_heads, 1)
        V = torch.stack(values).float().repeat_interleave(cfg.num_attention_heads // cfg.num_key_value_heads, 1)
        att = (torch.einsum("hd,khd->hk", q[0].float(), K) * hd**-0.5).softmax(-1)
        o = torch.einsum("hk,khd->hd", att, V).to(h.dtype).reshape(1, -1) @ w[p + "self_attn.o_proj.weight"].t()
        h = h + rms_norm_ref(o, w[p + "input_layernorm_2.weight"], eps)
        x = rms_norm_ref(h, w[p + "post_attention_layernorm.weight"], eps)
        m = (F.silu(x @ w[p + "mlp.gate_proj.weight"].t()) * (x @ w[p + "mlp.up_proj.weight"].t())) @ w[
            p + "mlp.down_proj.weight"
        ].t()
        return h + rms_norm_ref(m, w[p + "post_attention_layernorm_2.weight"], eps)

    @staticmethod
    def _version(j: int, d: int, i: int, num_prompt: int, loops: list[int], layout: KVLayout) -> int:
        """Which loop's KV of earlier token j a query of token i at loop d (0-based) sees."""
        exit_j = loops[j] - 1
        if layout is KVLayout.LAST_EXITED:
            return min(d, exit_j)
        if i < num_prompt:  # SHARED prefill: prompt tokens see each other's per-loop KV
            return d
        return exit_j  # SHARED decode: the plane holds j's exit-loop KV

    def generate(
        self,
        prompt: list[int],
        max_tokens: int,
        exit_fn=None,
        layout: KVLayout | str = KVLayout.LAST_EXITED,
        penalties: tuple[float, float, float] | None = None,
        bad_words: list[list[int]] | None = None,
    ) -> tuple[list[int], list[int]]:
        """Greedy generation. exit_fn(gates_so_far) -> depth for a decode token (None: all T loops);
        penalties: (repetition, presence, frequency) applied to every token's logits (`penalize_ref`);
        bad_words: token sequences never generated (`mask_bad_words_ref`).

        Returns (generated tokens, exit depth of each); recomputes from scratch for every token.
        """
        T = self.cfg.total_ut_steps
        tokens, loops = list(prompt), [T] * len(prompt)
        out, depths = [], []
        for _ in range(max_tokens):
            res = self.forward(tokens, len(prompt), loops, layout)
            logits = res.logits[-1] if penalties is None else penalize_ref(res.logits[-1], prompt, out, penalties)
            logits = logits if bad_words is None else mask_bad_words_ref(logits, out, bad_words)
            nxt = int(logits.argmax())
            out.append(nxt)
            depths.append(loops[-1])
            tokens.append(nxt)
            # The new token's depth is decided by its own gates: run it at full depth first to read them.
            loops.append(T)
            if exit_fn is not None:
                probe = self.forward(tokens, len(prompt), loops, layout)
                loops[-1] = exit_fn(probe.gates[-1])
        return out, depths
