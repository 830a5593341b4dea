"""Deterministic random Ouro checkpoints: a tiny `toy` model for tests and demos, and the real 1.4B/2.6B
shapes for benchmarks. They are written in the HF layout and load through exactly the same code as a
downloaded checkpoint (checkpoint.load_config / load_weights, tokenizer.load_tokenizer).

    python -m ouro_backend.model.toy --out DIR [--seed 0] [--shape toy|ouro-1.4b|ouro-2.6b] [--dtype D] [--shards N]
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
import time
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from tokenizers import Tokenizer

from ..config import OuroConfig
from .checkpoint import CheckpointError, expected_shapes, save_checkpoint
from .tokenizer import train_byte_level_bpe

EOS_IDS = [0, 2]  # <|endoftext|> and <|im_end|>
TOY_VERSION = "1"  # bump when the toy's weights or tokenizer change: cached toys are then rebuilt
_COMMON = dict(
    rope_theta=1e6,
    rms_norm_eps=1e-6,
    total_ut_steps=4,
    early_exit_threshold=1.0,
    bos_token_id=1,
    eos_token_id=tuple(EOS_IDS),
)
SHAPES: dict[str, dict] = {
    "toy": dict(
        _COMMON,
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        torch_dtype="float32",
    ),
    "ouro-1.4b": dict(
        _COMMON,
        vocab_size=49152,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=16,
        head_dim=128,
        max_position_embeddings=65536,
        torch_dtype="bfloat16",
    ),
}
SHAPES["ouro-2.6b"] = dict(SHAPES["ouro-1.4b"], num_hidden_layers=48)

# A small multilingual corpus: enough merges for a ~800-token vocabulary, and every script the tests stream.
CORPUS = """\
The quick brown fox jumps over the lazy dog. A looped language model runs the same layers several times:
each loop refines the hidden state, and an exit gate decides when the answer is good enough to stop.
Looped models trade parameters for computation. Ouro is a family of looped language models trained on
trillions of tokens. When the gate is confident, the token exits early and saves time for other requests.
The server streams tokens to the client as soon as they are ready, one small piece of text at a time.
Once upon a time there was a little robot who wanted to learn how to write stories. Every morning the
robot read a book, and every evening it wrote a new sentence. The sentences were short at first, but they
grew longer and more interesting as the days went by. "What are you writing?" asked the cat. "A story
about a cat who asks too many questions," said the robot, and they both laughed.
In the kitchen, the recipe called for two cups of flour, three eggs, a spoon of sugar and a pinch of salt.
Mix the dry ingredients first, then add the eggs one at a time. Bake for thirty minutes at 180 degrees.
The weather today is sunny with a few clouds in the afternoon; tomorrow it will rain in the north and the
wind will be strong near the coast. Temperatures between 12 and 18 degrees are expected this week.
def add(a, b):
    return a + b
for i in range(10):
    print(i, add(i, i * 2))
numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14159 1e-6 65536 49152
Questions and answers: What is the capital of France? Paris. How many legs does a spider have? Eight.
Why is the sky blue? Because of Rayleigh scattering of sunlight in the atmosphere.
User: Hello! Can you help me? Assistant: Of course, I am happy to help. What would you like to know?
Le café est très bon ce matin. Où est la bibliothèque? Je voudrais un thé, s'il vous plaît. Déjà vu, naïve,
élève, garçon, français, été, hôtel, être, forêt, cœur. Ça va très bien, merci beaucoup!
Über den Wolken muss die Freiheit wohl grenzenlos sein. Schöne Grüße aus München. Die Größe der Straße ist
groß. Mädchen, Käse, Bäcker, Fußball, fünf, über, hören, König.
El niño está en la montaña. ¿Dónde está el baño? ¡Qué día tan bonito! Mañana vamos a la playa con mi
señora y los niños. Corazón, canción, información, también, jamás.
héllo wörld: naïve café résumé crème brûlée façade jalapeño piñata smörgåsbord Ångström
你好，世界。今天天气很好。我们一起去公园散步吧。机器学习和语言模型正在改变世界。
这是一个循环语言模型。每个词元都可以提前退出。你好你好，世界世界。谢谢你的帮助。
こんにちは、世界。今日はいい天気ですね。ありがとうございます。日本語のテキストです。
안녕하세요, 세계. 감사합니다. Привет, мир! Спасибо большое. Γειά σου κόσμε. مرحبا بالعالم. שלום עולם
Emoji: 🙂 😀 😂 👍 🎉 🚀 ❤️ 🌍 🙂🙂 👍👍 🎉🎉 🚀🚀 ✨ 🔥 🤖 🐱 🍕 ☕ 🌧️ ☀️
Symbols: € £ ¥ © ® ™ ° ± × ÷ → ← ↑ ↓ ∞ ≈ ≠ ≤ ≥ α β γ δ λ π σ ω ∑ ∫ √
"""


def toy_config(shape: str = "toy", dtype: str | None = None) -> OuroConfig:
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose one of: {', '.join(SHAPES)}")
    cfg = OuroConfig(**dict(SHAPES[shape], torch_dtype=dtype or SHAPES[shape]["torch_dtype"]))
    cfg.validate()
    return cfg


def build_tokenizer_json() -> str:
    """A real byte-level BPE tokenizer trained offline on CORPUS."""
    return train_byte_level_bpe(CORPUS.splitlines(keepends=True), vocab_size=1000)


def init_weight(
    name: str, shape: tuple[int, ...], cfg: OuroConfig, seed: int, tokenizer_vocab: int, loop_change: float = 1.0
) -> torch.Tensor:
    """One tensor, seeded from (seed, name): the same values whatever the sharding or generation order.

    Scales (why; tuned with a dense reference forward on the toy):
    * Sandwich norms: each sublayer output is RMS-normed, then scaled by input_layernorm_2 /
      post_attention_layernorm_2, before joining the residual. Those two use weights ~0.2 (the other norms
      ~1), so each sublayer refines the residual instead of overwriting it: with ~1 the 2*L*T unit-RMS
      updates wash out the token identity, tokens collapse to one state and greedy text repeats one token.
    * `loop_change` (default 1) scales how much one loop changes the state: the sandwich weights (0.2 x it)
      and the spread of the other norm weights (0.1 x it; each loop's final norm multiplies the state by
      those weights again). Smaller, an early loop's argmax agrees with the last loop's more often: the
      draft/verify agreement of self-speculation (`ouro-bench --loop-change`).
    * Projections: std 1/sqrt(fan_in), so attention scores and MLP inputs are O(1) (attention not uniform).
    * Embeddings std 1 (same scale as the residual); lm_head std 2/sqrt(H): logits of std ~2.
    * Exit gate: std 1.5/sqrt(H), bias -0.25: gate logits ~N(-0.25, 1.5) per token and loop, so with
      exit_threshold 0.5 / 0.7 / 0.9 tokens exit at mixed depths 1..4 (on 300 toy tokens: 38/19/7/36 %,
      20/18/9/53 %, 3/16/7/74 % of tokens at depth 1/2/3/4). At 1.0 (the config default) depth is always 4.
    * lm_head rows past the tokenizer's vocabulary are zero (padding rows, logit 0, never the argmax in
      practice), so the toy emits ids its tokenizer can decode.
    """
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    H = cfg.hidden_size
    if name.endswith("layernorm_2.weight"):  # scales each sublayer's update to the residual
        t = 0.2 * loop_change * (1.0 + 0.1 * torch.randn(shape, generator=g))
    elif name.endswith("layernorm.weight") or name == "model.norm.weight":
        t = 1.0 + 0.1 * loop_change * torch.randn(shape, generator=g)
    elif name == "model.early_exit_gate.bias":
        t = torch.full(shape, -0.25)
    elif name == "model.early_exit_gate.weight":
        t = torch.randn(shape, generator=g) * (1.5 / math.sqrt(H))
    elif name == "model.embed_tokens.weight":
        t = torch.randn(shape, generator=g)
    elif name == "lm_head.weight":
        t = torch.randn(shape, generator=g) * (2.0 / math.sqrt(H))
        t[tokenizer_vocab:] = 0.0
    else:  # projections [out, in]
        t = torch.randn(shape, generator=g) * shape[1] ** -0.5
    return t.to(getattr(torch, cfg.torch_dtype))


class LazyWeights(Mapping[str, torch.Tensor]):
    """Generates each tensor when asked: writing a 2.6B checkpoint holds about one shard in memory."""

    def __init__(
        self, cfg: OuroConfig, seed: int, tokenizer_vocab: int, verbose: bool = False, loop_change: float = 1.0
    ) -> None:
        self.cfg, self.seed, self.vocab, self.verbose = cfg, seed, tokenizer_vocab, verbose
        self.loop_change = loop_change
        self.shapes = expected_shapes(cfg)

    def __getitem__(self, name: str) -> torch.Tensor:
        if self.verbose and name.endswith("q_proj.weight"):
            print(f"  generating {name.rsplit('.self_attn', 1)[0]}", file=sys.stderr, flush=True)
        return init_weight(name, self.shapes[name], self.cfg, self.seed, self.vocab, self.loop_change)

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def _shard_size(sizes: list[int], shards: int) -> int | None:
    """Smallest shard byte limit for which save_checkpoint's greedy packing makes at most `shards` files."""
    if shards <= 1:
        return None

    def count(limit: int) -> int:
        n, cur = 1, 0
        for s in sizes:
            if cur and cur + s > limit:
                n, cur = n + 1, 0
            cur += s
        return n

    lo, hi = max(sizes), sum(sizes)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if count(mid) <= shards else (mid + 1, hi)
    return lo


def write_checkpoint(
    out: str | os.PathLike,
    shape: str = "toy",
    seed: int = 0,
    dtype: str | None = None,
    shards: int | None = None,
    verbose: bool = False,
    loop_change: float = 1.0,
) -> Path:
    cfg = toy_config(shape, dtype)
    tok_json = build_tokenizer_json()
    vocab = Tokenizer.from_str(tok_json).get_vocab_size(with_added_tokens=True)
    assert vocab <= cfg.vocab_size, (vocab, cfg.vocab_size)
    elem = torch.empty(0, dtype=getattr(torch, cfg.torch_dtype)).element_size()
    sizes = [math.prod(s) * elem for s in expected_shapes(cfg).values()]
    if shards is None:  # about 2 GB per file for the large shapes, like HF exports
        shards = max(1, math.ceil(sum(sizes) / 2e9))
    if verbose:
        print(
            f"writing {shape} ({sum(sizes) / 1e9:.2f} GB, {cfg.torch_dtype}, {shards} shard(s)) to {out}",
            file=sys.stderr,
            flush=True,
        )
    t0 = time.time()
    path = save_checkpoint(
        out,
        cfg,
        LazyWeights(cfg, seed, vocab, verbose, loop_change),
        tok_json,
        generation_config={"bos_token_id": 1, "eos_token_id": EOS_IDS},
        shard_size_bytes=_shard_size(sizes, shards),
    )
    if verbose:
        print(f"done in {time.time() - t0:.1f}s", file=sys.stderr, flush=True)
    return path


def default_toy_path() -> Path:
    root = os.environ.get("OURO_CACHE_DIR") or os.path.join("~", ".cache", "ouro-triton")
    return Path(root).expanduser() / "toy"


def ensure_toy_checkpoint(path: str | os.PathLike | None = None) -> str:
    """The toy checkpoint's directory, built on first use. Built in a temp dir next to it and renamed into
    place, so readers never see a half-written checkpoint and racing processes are safe (the loser of
    the rename discards its copy). A toy of another TOY_VERSION is replaced."""
    final = Path(path).expanduser() if path else default_toy_path()
    marker = final / "TOY_VERSION"
    if marker.is_file() and marker.read_text().strip() == TOY_VERSION:
        return str(final)
    if final.is_dir() and not marker.is_file() and any(final.iterdir()):
        raise CheckpointError(f"{final} exists and is not a toy checkpoint (no TOY_VERSION): not replacing it")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        write_checkpoint(tmp)
        (tmp / "TOY_VERSION").write_text(TOY_VERSION + "\n")
        tmp.chmod(0o755)  # mkdtemp makes it 0700
        if final.exists() and not (marker.is_file() and marker.read_text().strip() == TOY_VERSION):
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            try:
                os.rename(final, old)  # stale version: move aside, then take its place
                shutil.rmtree(old, ignore_errors=True)
            except OSError:
                pass  # another process replaced it first
        try:
            os.rename(tmp, final)
        except OSError:  # another process won the race; its copy is identical
            if not (final / "TOY_VERSION").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(final)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m ouro_backend.model.toy", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output directory (HF layout)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shape", default="toy", choices=list(SHAPES))
    p.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="weight dtype (default: float32 for toy, bfloat16 for the large shapes)",
    )
    p.add_argument("--shards", type=int, default=None, help="number of safetensors files (default: ~2 GB each)")
    p.add_argument(
        "--loop-change",
        type=float,
        default=1.0,
        help="how much each loop changes the state (1: default); smaller makes early loops agree more with the last",
    )
    args = p.parse_args(argv)
    path = write_checkpoint(
        args.out, args.shape, args.seed, args.dtype, args.shards, verbose=True, loop_change=args.loop_change
    )
    print(path)


if __name__ == "__main__":
    main()
