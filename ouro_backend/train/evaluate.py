"""How good the demo model is (docs/demo-model.md), in numbers:

* held-out text (paragraphs separated by <|endoftext|>, as in training), teacher-forced (every position sees its
full-depth context): cross-entropy at each loop;
  the cross-entropy when each position exits where the gate says (the engine's `ouro` rule: fp32 hazard,
  exit once 1 - prod(1 - lambda) >= threshold) and the depth histogram that gives; how often loop d's
  argmax equals the last loop's (the draft/verify agreement of self-speculation); the cross-entropy of
  deferred deep batching's readout (`deferred_readout`: loop r, and loop T at every B-th prediction);
* greedy continuations of plain English prompts through the engine: the share of their words (3+ letters)
  found in a system word list, whether they are printable, how much of each is one repeated phrase, and
  the exit depths the gate chose.

    python -m ouro_backend.train.evaluate [--model DIR] [--heldout FILE] [--words /usr/share/dict/american-english]
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from ..model.checkpoint import load_config, load_weights
from ..model.tokenizer import load_tokenizer
from .looped_lm import LoopedLM
from .train import encode

PROMPTS = [
    "Once upon a time, there was a little",
    "The weather today is",
    "She looked at him and said",
    "It is a truth universally acknowledged that",
    "My dear friend,",
    "In the morning, the children",
]
WORD_LIST = "/usr/share/dict/american-english"  # Debian's wamerican


def gate_depths(gate_logits: torch.Tensor, threshold: float) -> torch.Tensor:
    """Exit depth (1..T) of every position under the `ouro` rule, as exit_policy.exit_rule computes it."""
    T = gate_logits.shape[0]
    remaining = torch.ones_like(gate_logits[0])
    depth = torch.full(gate_logits.shape[1:], T, dtype=torch.long)
    undecided = torch.ones_like(depth, dtype=torch.bool)
    for t in range(T - 1):
        remaining = remaining * (1.0 - torch.sigmoid(gate_logits[t]))
        fire = undecided & ((1.0 - remaining).double() >= threshold)
        depth[fire] = t + 1
        undecided &= ~fire
    return depth


def deferred_readout_depth(num_positions: int, interval: int, readout_loop: int, num_loops: int) -> torch.Tensor:
    """The readout loop (1-based) of each teacher-forced position under deferred deep batching, for a window
    whose first token is the prompt: the prediction from position s is output token s, read out at loop T
    when s % B == 0 (token 0 is the prompt's) and at loop r otherwise. The context is the same as at full
    depth (deferral changes when the deep loops run, not what they compute), so only the readout differs."""
    s = torch.arange(num_positions)
    return torch.where(s % interval == 0, num_loops, readout_loop)


@torch.no_grad()
def heldout_report(
    model_dir: str,
    text: str,
    thresholds: Sequence[float] = (0.5, 0.7, 0.9),
    window: int = 256,
    max_windows: int = 1024,
    deferred_intervals: Sequence[int] = (1, 4, 8, 16),
    readout_loop: int = 2,
) -> dict:
    cfg = load_config(model_dir)
    model = LoopedLM(cfg).eval()
    model.load_state_dict(load_weights(model_dir, cfg, torch.float32, "cpu"))
    ids = encode(load_tokenizer(model_dir), [x for x in text.split("\n\n") if x.strip()]).tolist()  # as trained
    rows = [ids[i : i + window + 1] for i in range(0, len(ids) - window, window)][:max_windows]
    batch = torch.tensor(rows)
    states, gates = model(batch[:, :-1])
    target = batch[:, 1:]
    logits = [model.lm_head(s).float() for s in states]
    ce = torch.stack(
        [F.cross_entropy(lg.flatten(0, 1), target.flatten(), reduction="none").view_as(target) for lg in logits]
    )  # [T, B, S]
    T = cfg.total_ut_steps
    last = logits[-1].argmax(-1)
    out = dict(
        tokens=int(target.numel()),
        ce_per_loop=[round(float(c.mean()), 4) for c in ce],
        agreement_with_last_loop={
            d + 1: round(float((logits[d].argmax(-1) == last).float().mean()), 4) for d in range(T - 1)
        },
        gate={},
        deferred_readout=dict(readout_loop=readout_loop, intervals={}),
    )
    full = ce[-1].mean()
    for B in deferred_intervals:
        depth = deferred_readout_depth(target.shape[1], B, readout_loop, T).expand_as(target)
        deferred_ce = ce.gather(0, (depth - 1)[None]).squeeze(0).mean()
        out["deferred_readout"]["intervals"][str(B)] = dict(
            ce=round(float(deferred_ce), 4),
            ce_vs_full=round(float(deferred_ce - full), 4),
            mean_depth=round(float(depth.float().mean()), 3),
        )
    for thr in thresholds:
        depth = gate_depths(gates, thr)
        exit_ce = ce.gather(0, (depth - 1)[None]).squeeze(0)
        hist = torch.bincount(depth.flatten(), minlength=T + 1)[1:]
        out["gate"][str(thr)] = dict(
            ce=round(float(exit_ce.mean()), 4),
            mean_depth=round(float(depth.float().mean()), 3),
            depth_share=[round(float(h) / depth.numel(), 4) for h in hist],
            ce_vs_full=round(float(exit_ce.mean() - ce[-1].mean()), 4),
        )
    return out


def words(text: str) -> list[str]:
    return re.findall(r"[A-Za-z]+", text)


def repeated_share(text: str, n: int = 4) -> float:
    """The share of a text's word n-grams that already occurred earlier in it: 0 without a repeated
    phrase, 0.5 for a sentence said twice, towards 1 for one phrase over and over."""
    w = [x.lower() for x in words(text)]
    grams = [tuple(w[i : i + n]) for i in range(len(w) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams) if grams else 0.0


def load_word_list(path: str = WORD_LIST) -> set[str]:
    return {w.strip().lower() for w in Path(path).read_text(encoding="utf-8", errors="replace").splitlines()}


def english_report(
    model_dir: str | None,
    word_list: set[str],
    prompts: Sequence[str] = PROMPTS,
    max_tokens: int = 40,
    threshold: float = 0.7,
) -> dict:
    """Greedy continuations through the engine (fp32, CPU), at full depth and with the gate at `threshold`."""
    from ..engine.llm_engine import LLM
    from ..sampling_params import SamplingParams

    llm = LLM(model=model_dir, device="cpu", dtype="float32")
    report = dict(threshold=threshold, prompts={})
    all_words, depths = [], Counter()
    for thr in (1.0, threshold):
        for p, o in zip(
            prompts,
            llm.generate(list(prompts), SamplingParams(max_tokens=max_tokens, temperature=0.0, exit_threshold=thr)),
        ):
            long_words = [w.lower() for w in words(o.text) if len(w) >= 3]
            entry = dict(
                text=o.text,
                exit_depths=o.exit_depths[1:],
                known_words=round(sum(w in word_list for w in long_words) / max(1, len(long_words)), 3),
                printable=all(c.isprintable() or c in "\n\t" for c in o.text),
                repeated_share=round(repeated_share(o.text), 3),
            )
            report["prompts"].setdefault(p, {})["full" if thr == 1.0 else f"gate {thr}"] = entry
            if thr == 1.0:
                all_words += long_words
            else:
                depths.update(o.exit_depths[1:])
    report["known_words"] = round(sum(w in word_list for w in all_words) / max(1, len(all_words)), 3)
    report["gate_depth_histogram"] = {d: depths[d] for d in sorted(depths)}
    return report


def main(argv: list[str] | None = None) -> None:
    from ..models import default_model

    p = argparse.ArgumentParser(prog="python -m ouro_backend.train.evaluate", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: the demo model)")
    p.add_argument("--heldout", type=Path, help="held-out text (e.g. the corpus's heldout.txt)")
    p.add_argument("--words", default=WORD_LIST, help="system word list (Debian's wamerican)")
    p.add_argument("--out", type=Path, help="write the report JSON here")
    args = p.parse_args(argv)
    model = args.model or default_model()
    report = dict(model=str(model))
    if args.heldout:
        report["heldout"] = heldout_report(model, args.heldout.read_text(encoding="utf-8"))
    report["english"] = english_report(model, load_word_list(args.words))
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
