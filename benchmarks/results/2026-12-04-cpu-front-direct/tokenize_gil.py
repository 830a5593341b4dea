"""Does tokenizing a prompt hold the GIL? (`tokenizers`, the demo tokenizer, the prompts served.py makes.)
Times `encode` alone, then `encode` and `encode_batch` beside a thread that spins in Python: a call that
holds the GIL halves the spinner's rate; one that releases it leaves the spinner at full speed but must wait
for the GIL to come back (up to Python's 5 ms switch interval) before it returns.

    PYTHONPATH=$PWD python benchmarks/results/2026-12-04-cpu-front-direct/tokenize_gil.py
"""

from __future__ import annotations

import json
import threading
import time

import tokenizers

from benchmarks.served import make_prompts
from ouro_backend.model.tokenizer import load_tokenizer
from ouro_backend.models import default_model


def spin_beside(work, prompts, seconds: float) -> tuple[float, float]:
    """(the spinner's loop iterations per second, calls of work per second) while both run."""
    stop, count = [False], [0]

    def spin():
        n = 0
        while not stop[0]:
            n += 1
        count[0] = n

    t = threading.Thread(target=spin)
    t.start()
    t0, calls = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        if work is None:
            time.sleep(0.001)
        else:
            work(prompts[calls % len(prompts)])
            calls += 1
    elapsed = time.perf_counter() - t0
    stop[0] = True
    t.join()
    return count[0] / elapsed, calls / elapsed


def main() -> None:
    tok = load_tokenizer(default_model())
    prompts = [text for text, _ in make_prompts(default_model(), 128, 200)]
    encode = lambda p: tok.encode(p, add_special_tokens=False)  # noqa: E731
    encode_batch = lambda p: tok.encode_batch([p], add_special_tokens=False)  # noqa: E731
    for p in prompts[:50]:
        encode(p)
    t0 = time.perf_counter()
    for p in prompts * 5:
        encode(p)
    alone_us = (time.perf_counter() - t0) / (5 * len(prompts)) * 1e6
    spinner_alone, _ = spin_beside(None, prompts, 2)
    rows = {"tokenizers": tokenizers.__version__, "encode_alone_us": round(alone_us, 1)}
    rows["spinner_alone_per_s"] = round(spinner_alone)
    for name, fn in (("encode", encode), ("encode_batch", encode_batch)):
        spinner, calls = spin_beside(fn, prompts, 3)
        rows[name] = {"spinner_share": round(spinner / spinner_alone, 2), "calls_per_s": round(calls)}
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
