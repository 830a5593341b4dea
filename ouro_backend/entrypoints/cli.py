"""`ouro-generate`: offline generation from the command line (prompt in; text and exit depths out)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time

from ..config import ConfigError, EngineConfig
from ..sampling_params import RequestError, SamplingParams


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One --flag per EngineConfig field, so the CLI and the Triton parameters share one option set."""
    group = parser.add_argument_group("engine options (see ouro_backend/config.py)")
    taken = set(parser._option_string_actions)
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        if flag in taken:  # a per-request flag of the same name exists: the engine's gets a prefix
            flag = "--engine-" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        group.add_argument(flag, dest="engine_" + f.name, default=None, metavar="V", help=f"default: {default!r}")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    values = {k[len("engine_") :]: v for k, v in vars(args).items() if k.startswith("engine_") and v is not None}
    return EngineConfig.from_strings(values)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ouro-generate", description=__doc__)
    p.add_argument("prompt", nargs="+", help="prompt text (several prompts run batched)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--min-loops", type=int, default=1)
    p.add_argument("--max-loops", type=int, default=None)
    p.add_argument("--exit-threshold", type=float, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--stop", action="append", default=[])
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    add_engine_args(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    from ..engine.llm_engine import LLM

    try:
        cfg = engine_config_from_args(args)
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            min_loops=args.min_loops,
            max_loops=args.max_loops,
            exit_threshold=args.exit_threshold,
            ignore_eos=args.ignore_eos,
            stop=args.stop,
        )
        llm = LLM(config=cfg)
        t0 = time.monotonic()
        outs = llm.generate(args.prompt, params)
    except (ConfigError, RequestError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    elapsed = time.monotonic() - t0
    for prompt, out in zip(args.prompt, outs):
        if args.json:
            print(
                json.dumps(
                    dict(
                        prompt=prompt,
                        text=out.text,
                        token_ids=out.token_ids,
                        exit_depths=out.exit_depths,
                        finish_reason=out.finish_reason,
                    )
                )
            )
            continue
        depths = out.exit_depths
        print(
            f"prompt: {prompt!r}\ntext:   {out.text!r}\nexit depths: {depths} (mean "
            f"{sum(depths) / max(1, len(depths)):.2f})  finish: {out.finish_reason}"
        )
    n = sum(len(o.token_ids) for o in outs)
    print(f"{n} tokens in {elapsed:.2f}s ({n / elapsed:.1f} tok/s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
