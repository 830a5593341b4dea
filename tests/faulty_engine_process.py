"""The real engine process (ouro_backend.serving.engine_server.main) with a fault injected, for
tests/test_fault_isolation.py, which starts it in place of the engine process: the token bookkeeping
(`LLMEngine._append`) of a request whose id starts with FAULTY raises once that request has AFTER tokens.
Nothing else differs; this module is not part of the package."""

import sys

from ouro_backend.engine.llm_engine import LLMEngine
from ouro_backend.serving import engine_server

FAULTY = "faulty"
AFTER = 3

_append = LLMEngine._append


def _faulty_append(self, e):
    if e.seq.request_id.startswith(FAULTY) and len(e.seq.output_ids) >= AFTER:
        raise RuntimeError(f"injected fault in {e.seq.request_id}")
    _append(self, e)


if __name__ == "__main__":
    LLMEngine._append = _faulty_append
    sys.exit(engine_server.main())
