"""When the scheduler speculates (docs/engine.md, "Automatic fallback"): the speculation policy and its
statistics. The step itself is `speculation.py`."""

from __future__ import annotations


class SpecPolicy:
    """When to speculate (docs/engine.md, "Automatic fallback"): a step of K drafts of d loops and a verify
    pass of T - d loops costs (K + 1) d + T - d loop passes over the batch, and emits E = 1 + a + ... + a^K
    tokens per row at acceptance rate a, where plain decoding spends T passes a token. While each pass is
    bound by reading the weights (few rows), the step pays when E T > (K + 1) d + T - d. So the engine
    speculates when the verify pass stays small (rows x (K + 1) <= max_verify_tokens) and the expected gain
    at the estimated acceptance exceeds 1. The estimate is an exponential average of each step's
    acceptance (a convex combination of numbers in [0, 1]: it cannot diverge), starting at 1 so the engine
    tries; while it does not speculate, every `probe_every`-th decode launch speculates to re-measure."""

    def __init__(
        self, K: int, d: int, T: int, auto: bool, max_verify_tokens: int, weight: float = 0.2, probe_every: int = 16
    ):
        self.K, self.d, self.T, self.auto = K, d, T, auto
        self.max_verify_tokens, self.weight, self.probe_every = max_verify_tokens, weight, probe_every
        self.acceptance = 1.0
        self._seen = (0, 0)  # drafted, accepted already folded into the estimate
        self._skipped = 0

    def expected_gain(self, a: float) -> float:
        tokens = sum(a**i for i in range(self.K + 1))
        return tokens * self.T / ((self.K + 1) * self.d + self.T - self.d)

    def observe(self, drafted: int, accepted: int) -> None:
        """Cumulative counters (RunnerStats.spec_drafted / spec_accepted) after a launch was read."""
        new_d, new_a = drafted - self._seen[0], accepted - self._seen[1]
        if new_d > 0:
            self.acceptance += self.weight * (new_a / new_d - self.acceptance)
            self._seen = (drafted, accepted)

    def decide(self, rows: int) -> bool:
        if not self.auto:
            return True
        if rows * (self.K + 1) > self.max_verify_tokens:
            return False
        if self.expected_gain(self.acceptance) > 1.0:
            return True
        self._skipped += 1
        if self._skipped >= self.probe_every:
            self._skipped = 0
            return True
        return False


def mean_accepted_length(drafted: int, accepted: int, K: int) -> float:
    """Tokens emitted per row and speculative step (1 + accepted drafts), from draft counts; 0 if none."""
    return 1 + accepted * K / drafted if drafted else 0.0
