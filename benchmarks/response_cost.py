"""Host cost of building one streamed response's tensors (CPU, no server): the client's tensors straight
from the response's fields (`protocol.client_response_arrays`, the `ouro` front's path), against the engine's
tensors post-processed (`engine_response_arrays` + `postprocess_arrays`, the ensemble's path). Served, the
saving shows as the front stubs' CPU per token (ouro_backend/serving/README.md).

    python benchmarks/response_cost.py [--tokens 2] [--calls 5000]
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=2, help="tokens per response")
    p.add_argument("--calls", type=int, default=5000)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()

    from ouro_backend.model.tokenizer import load_tokenizer
    from ouro_backend.models import default_model
    from ouro_backend.serving import protocol

    tok = load_tokenizer(default_model())
    fields = dict(
        output_ids=list(range(100, 100 + args.tokens)),
        prefix_ids=[5, 6, 7, 8, 9],
        exit_depths=[4] * args.tokens,
        trim_chars=0,
        num_input_tokens=128,
        finish_reason=None,
        echo_text="",
        return_flags=(False,) * len(protocol.RETURN_FLAGS),
    )
    paths = {
        "front (client_response_arrays)": lambda: protocol.client_response_arrays(tok, **fields),
        "ensemble (engine_response_arrays + postprocess_arrays)": lambda: protocol.postprocess_arrays(
            tok, protocol.engine_response_arrays(**fields)
        ),
    }
    for name, fn in paths.items():
        for _ in range(500):
            fn()
        runs = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            for _ in range(args.calls):
                fn()
            runs.append((time.perf_counter() - t) / args.calls * 1e6)
        print(
            f"{name}: median {statistics.median(runs):.1f} us per response "
            f"(repeats {', '.join(f'{r:.1f}' for r in runs)})"
        )


if __name__ == "__main__":
    main()
