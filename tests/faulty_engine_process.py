"""The real engine process (ouro_backend.serving.engine_server.main) with a fault injected, for
tests/test_fault_isolation.py, which starts it in place of the engine process: appending a token
(`Sequence.append_token`) to a request whose id starts with FAULTY raises once that request has AFTER tokens.
Nothing else differs; this module is not part of the package."""

import sys

from ouro_backend.engine.sequence import Sequence
from ouro_backend.serving import engine_server

FAULTY = "faulty"
AFTER = 3

_append_token = Sequence.append_token


def _faulty_append_token(self, token, depth, logprob):
    if self.request_id.startswith(FAULTY) and len(self.output_ids) >= AFTER:
        raise RuntimeError(f"injected fault in {self.request_id}")
    _append_token(self, token, depth, logprob)


if __name__ == "__main__":
    Sequence.append_token = _faulty_append_token
    sys.exit(engine_server.main())
