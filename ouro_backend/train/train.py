"""Train the demo model: a byte-level BPE tokenizer and a small looped Ouro on the corpus of
`ouro_backend.train.corpus`, with the Ouro exit-gate objective (looped_lm.ouro_loss). Reproducible from
`--seed`; logs every loop's loss; writes an HF-layout checkpoint that the engine loads like any other.

    python -m ouro_backend.train.train --corpus DIR --out MODEL_DIR [--device cuda] [--steps N ...]

Progress goes to stderr; MODEL_DIR/training_log.jsonl has one line per evaluation (train and held-out loss
per loop, the mean exit distribution) and the run's options.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from ..config import OuroConfig
from ..model.checkpoint import save_checkpoint
from ..model.tokenizer import train_byte_level_bpe
from .looped_lm import LoopedLM, ouro_loss

EOT = 0  # <|endoftext|> between documents


@dataclasses.dataclass
class TrainOptions:
    """The defaults are the recipe of the shipped demo model (docs/demo-model.md)."""

    steps: int = 1000
    batch: int = 64
    seq_len: int = 256
    lr: float = 2e-3
    warmup: int = 100
    weight_decay: float = 0.1
    dropout: float = 0.2  # the corpus is small (1.5M tokens): without it held-out loss turns up after ~5 epochs
    entropy_weight: float = 0.1
    eval_every: int = 100
    max_minutes: float = 0.0  # > 0: stop early (after an evaluation) when the run would pass this
    seed: int = 0
    vocab_size: int = 4096
    hidden_size: int = 320
    intermediate_size: int = 864
    num_hidden_layers: int = 4
    num_attention_heads: int = 5
    total_ut_steps: int = 4


def model_config(o: TrainOptions) -> OuroConfig:
    cfg = OuroConfig(
        vocab_size=o.vocab_size,
        hidden_size=o.hidden_size,
        intermediate_size=o.intermediate_size,
        num_hidden_layers=o.num_hidden_layers,
        num_attention_heads=o.num_attention_heads,
        num_key_value_heads=o.num_attention_heads,
        head_dim=o.hidden_size // o.num_attention_heads,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        total_ut_steps=o.total_ut_steps,
        early_exit_threshold=1.0,
        torch_dtype="bfloat16",
        bos_token_id=1,
        eos_token_id=(0, 2),
    )
    cfg.validate()
    return cfg


def paragraphs_of(path: Path) -> list[str]:
    return [p for p in path.read_text(encoding="utf-8").split("\n\n") if p.strip()]


def encode(tok: Tokenizer, paragraphs: list[str]) -> np.ndarray:
    """One stream: each paragraph's ids followed by <|endoftext|>."""
    ids = []
    for enc in tok.encode_batch(paragraphs):
        ids.extend(enc.ids)
        ids.append(EOT)
    return np.asarray(ids, dtype=np.int32)


def batches(stream: np.ndarray, batch: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - seq_len - 1, (batch,), generator=gen)
    return torch.from_numpy(np.stack([stream[s : s + seq_len + 1] for s in starts.tolist()])).long()


@torch.no_grad()
def evaluate(model: LoopedLM, stream: np.ndarray, o: TrainOptions, device: torch.device) -> dict:
    """Held-out loss per loop over consecutive windows (all of them, up to 64 batches)."""
    model.eval()
    n = (len(stream) - 1) // o.seq_len
    rows = [stream[i * o.seq_len : i * o.seq_len + o.seq_len + 1] for i in range(min(n, 64 * o.batch))]
    sums, count = None, 0
    for i in range(0, len(rows), o.batch):
        ids = torch.from_numpy(np.stack(rows[i : i + o.batch])).long().to(device)
        with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
            _, st = ouro_loss(model, ids, o.entropy_weight)
        vals = np.array(st["ce_per_loop"] + [st["expected_ce"]] + st["exit_dist"]) * len(ids)
        sums = vals if sums is None else sums + vals
        count += len(ids)
    model.train()
    T = o.total_ut_steps
    v = sums / count
    return dict(
        ce_per_loop=v[:T].round(4).tolist(), expected_ce=round(float(v[T]), 4), exit_dist=v[T + 1 :].round(4).tolist()
    )


def train(corpus: Path, out: Path, o: TrainOptions, device: torch.device) -> dict:
    torch.manual_seed(o.seed)
    t0 = time.time()
    train_pars, held_pars = paragraphs_of(corpus / "train.txt"), paragraphs_of(corpus / "heldout.txt")
    tok_json = train_byte_level_bpe((p + "\n\n" for p in train_pars), o.vocab_size)
    tok = Tokenizer.from_str(tok_json)
    train_ids, held_ids = encode(tok, train_pars), encode(tok, held_pars)
    log(
        f"tokenizer: {tok.get_vocab_size()} ids; corpus {len(train_ids):,} train / {len(held_ids):,} held-out "
        f"tokens ({time.time() - t0:.0f}s)"
    )
    cfg = model_config(o)
    model = LoopedLM(cfg, o.dropout).to(device)
    params = sum(p.numel() for p in model.parameters())
    log(
        f"model: {params / 1e6:.2f}M parameters, {cfg.num_hidden_layers} layers x {cfg.total_ut_steps} loops, "
        f"hidden {cfg.hidden_size}; {o.steps} steps of {o.batch} x {o.seq_len} tokens "
        f"({o.steps * o.batch * o.seq_len / len(train_ids):.1f} epochs)"
    )
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [dict(params=decay, weight_decay=o.weight_decay), dict(params=rest, weight_decay=0.0)],
        lr=o.lr,
        betas=(0.9, 0.95),
        fused=device.type == "cuda",
    )
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / o.warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / o.steps)))
    )
    gen = torch.Generator().manual_seed(o.seed)
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "training_log.jsonl"
    with open(log_path, "w") as f:
        f.write(
            json.dumps(
                dict(
                    options=dataclasses.asdict(o),
                    parameters=params,
                    train_tokens=int(len(train_ids)),
                    heldout_tokens=int(len(held_ids)),
                )
            )
            + "\n"
        )
    best, best_state, recent = float("inf"), None, []
    for step in range(1, o.steps + 1):
        ids = batches(train_ids, o.batch, o.seq_len, gen).to(device, non_blocking=True)
        with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
            loss, st = ouro_loss(model, ids, o.entropy_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        recent.append(st)
        out_of_time = o.max_minutes > 0 and time.time() - t0 > o.max_minutes * 60
        if step % o.eval_every == 0 or step == o.steps or out_of_time:
            held = evaluate(model, held_ids, o, device)
            tr = dict(
                ce_per_loop=np.mean([r["ce_per_loop"] for r in recent], 0).round(4).tolist(),
                exit_dist=np.mean([r["exit_dist"] for r in recent], 0).round(4).tolist(),
            )
            recent = []
            rec = dict(step=step, seconds=round(time.time() - t0, 1), lr=sched.get_last_lr()[0], train=tr, heldout=held)
            with open(log_path, "a") as f:
                f.write(json.dumps(rec) + "\n")
            log(
                f"step {step}: train CE per loop {tr['ce_per_loop']}, held-out {held['ce_per_loop']}, "
                f"exit dist {held['exit_dist']} ({rec['seconds']}s)"
            )
            if held["expected_ce"] < best:  # keep the best held-out expected loss (small corpus: it overfits)
                best, best_state = held["expected_ce"], {k: v.detach().clone() for k, v in model.state_dict().items()}
            if out_of_time:
                log(f"stopping at step {step}: --max-minutes {o.max_minutes} reached")
                break
    model.load_state_dict(best_state)
    save_checkpoint(
        out,
        cfg,
        model.export_state(torch.bfloat16),
        tok_json,
        generation_config={"bos_token_id": 1, "eos_token_id": [0, 2]},
    )
    log(f"saved {out} (best held-out expected CE {best:.4f}) in {time.time() - t0:.0f}s")
    return dict(best_expected_ce=best)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m ouro_backend.train.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", required=True, type=Path, help="directory with train.txt and heldout.txt")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    for f in dataclasses.fields(TrainOptions):
        p.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    args = p.parse_args(argv)
    o = TrainOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainOptions)})
    train(args.corpus, args.out, o, torch.device(args.device))


if __name__ == "__main__":
    main()
