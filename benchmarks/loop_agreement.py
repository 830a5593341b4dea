"""How often an early loop's argmax equals the last loop's on a random-weight checkpoint, per `loop_change`
(toy.init_weight): the draft/verify agreement that self-speculation's acceptance follows. Teacher-forced
on random token ids, fp32, with the training model (`LoopedLM`, which computes the engine's model);
the weights are generated in memory, nothing is written.

    python benchmarks/loop_agreement.py [--shape ouro-1.4b] [--tokens 48] 1 0.05 0.02 0.01
"""

import argparse
import json
import time

import torch

from ouro_backend.model.toy import LazyWeights, toy_config
from ouro_backend.train.looped_lm import LoopedLM


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("loop_change", type=float, nargs="+")
    ap.add_argument("--shape", default="ouro-1.4b")
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args()
    cfg = toy_config(args.shape, "float32")
    ids = torch.randint(3, cfg.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(1))
    for change in args.loop_change:
        t0 = time.time()
        weights = LazyWeights(cfg, 0, cfg.vocab_size, loop_change=change)
        model = LoopedLM(cfg).eval()
        model.load_state_dict({k: weights[k].float() for k in weights})
        with torch.no_grad():
            states, _ = model(ids)
            top = [model.lm_head(s)[0].argmax(-1) for s in states]
        agree = {d + 1: round(float((top[d] == top[-1]).float().mean()), 3) for d in range(len(top) - 1)}
        print(
            json.dumps(dict(loop_change=change, agreement_with_last_loop=agree, seconds=round(time.time() - t0))),
            flush=True,
        )
        del model


if __name__ == "__main__":
    main()
