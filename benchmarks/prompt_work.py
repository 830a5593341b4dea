"""A fresh prompt through the engine's own steps, timed, and the FLOPs it takes: what `roofline.py`'s prompt chunk
and `round_profile.py --prompt-tokens` measure."""

from __future__ import annotations

import random
import time

import torch

from ouro_backend import LLMEngine, SamplingParams


def fresh_prompt_ms(eng: LLMEngine, tokens: int, rng: random.Random, request_id: str) -> float:
    """Wall ms of one prompt of ``tokens`` random token ids (never seen before, so no prefix-cache hit) run to
    its one output token (all four loops, greedy), the engine stepping until that token is on the host; the
    device is drained after the clock stops."""
    ids = [rng.randrange(3, eng.runner.model.cfg.vocab_size) for _ in range(tokens)]
    torch.cuda.synchronize()
    t = time.perf_counter()
    eng.add_request(request_id, ids, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    while eng.get_num_unfinished_requests():
        eng.step()
    ms = (time.perf_counter() - t) * 1e3
    torch.cuda.synchronize()
    return ms


def prompt_flops(eng: LLMEngine, tokens: int) -> tuple[float, float]:
    """(projection FLOPs, attention FLOPs) of one prompt of ``tokens`` tokens: every loop's weights times every
    token, plus the LM head for the last token; attention's QK^T and PV over the causal half."""
    m = eng.runner.model
    cfg = m.cfg
    loop_params = sum(t.numel() for layer in m.layers for t in vars(layer).values())
    gemm = cfg.num_loops * 2 * tokens * loop_params + 2 * m.lm_head.numel()
    attn = cfg.num_loops * cfg.num_hidden_layers * 2 * tokens * tokens * cfg.num_attention_heads * cfg.head_dim
    return float(gemm), float(attn)
