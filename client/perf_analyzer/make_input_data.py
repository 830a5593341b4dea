#!/usr/bin/env python3
"""Write a perf_analyzer `--input-data` JSON for the `ouro` / `ouro_ensemble` models.

    python client/perf_analyzer/make_input_data.py --out input_data.json --max-tokens 64 --num-prompts 16

Shapes follow the models' config (max_batch_size 1, scalars dims [1]): perf_analyzer adds the batch dim,
so each entry is a one-element list. Streaming is on (`stream: true`, run perf_analyzer with --streaming),
EOS ignored so every request generates exactly max_tokens, and the prompt is not echoed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from client.ouro_client import SAMPLE_PROMPTS as PROMPTS


def make_input_data(
    num_prompts: int = 8,
    max_tokens: int = 32,
    temperature: float = 0.0,
    exit_threshold: float | None = None,
    prompt_words: int = 0,
    stream: bool = True,
    prompts: list[str] | None = None,
) -> dict:
    """`prompts` replaces the built-in sample prompts (num_prompts entries are made, cycling through them)."""
    prompts = prompts or PROMPTS
    entries = []
    for i in range(num_prompts):
        prompt = prompts[i % len(prompts)]
        if prompt_words:  # a longer prompt of about this many words
            words = (" ".join(prompts[(i + k) % len(prompts)] for k in range(len(prompts)))).split()
            prompt = " ".join((words * (prompt_words // len(words) + 1))[:prompt_words])
        entry = {
            "text_input": [prompt],
            "max_tokens": [max_tokens],
            "stream": [stream],
            "ignore_eos": [True],
            "exclude_input_in_output": [True],
            "temperature": [temperature],
        }
        if exit_threshold is not None:
            entry["exit_threshold"] = [exit_threshold]
        entries.append(entry)
    return {"data": entries}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="-", help="output file (default: stdout)")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--exit-threshold", type=float, default=None)
    p.add_argument("--prompt-words", type=int, default=0, help="make prompts about this many words long")
    p.add_argument("--no-stream", action="store_true")
    p.add_argument("--prompt", action="append", default=None, help="prompt (repeatable; default: built-in set)")
    args = p.parse_args(argv)
    data = make_input_data(
        args.num_prompts,
        args.max_tokens,
        args.temperature,
        args.exit_threshold,
        args.prompt_words,
        not args.no_stream,
        args.prompt,
    )
    text = json.dumps(data, indent=1, ensure_ascii=False)
    if args.out == "-":
        print(text)
    else:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
