"""Per-request generation options, validated on construction (and again, against the engine's limits, when
a request is added: `LLMEngine.add_request`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer


class RequestError(ValueError):
    """A bad request (prompt or sampling value). The engine and other requests are unaffected."""


@dataclass
class SamplingParams:
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    seed: int | None = None  # per-request stream: same tokens alone or in any batch
    ignore_eos: bool = False
    stop: Sequence[str] = field(default_factory=list)  # stop strings; the text never reaches the caller
    stop_token_ids: Sequence[int] = field(default_factory=list)
    # Ouro's loop controls (docs/model.md, "The exit gate"). max_loops None: the model's total_ut_steps.
    min_loops: int = 1
    max_loops: int | None = None
    exit_threshold: float | None = None  # None: the engine's exit_threshold
    exit_trace: Sequence[int] | None = None  # depths for exit_mode=trace, one per decode step (cycled)
    # Penalties (vLLM's semantics, applied to the logits before temperature, top-k and top-p, greedy rows
    # included; docs/engine.md, "Penalties"): a logit of a token seen in the prompt or the output so far is
    # divided by repetition_penalty when positive, multiplied when negative; then frequency_penalty times
    # the token's count in the output and presence_penalty if it occurs there at all are subtracted.
    repetition_penalty: float = 1.0  # > 0; 1: off
    presence_penalty: float = 0.0  # [-2, 2]; 0: off
    frequency_penalty: float = 0.0  # [-2, 2]; 0: off
    # Words never generated (vLLM's bad_words): each is tokenized as is and with a leading space
    # (`bad_words_token_ids`); the last token of such a sequence is masked whenever the output so far ends
    # with the rest of it (always, for a one-token word).
    bad_words: Sequence[str] = field(default_factory=list)
    # Hand each new token's logprob out with it (RequestOutput.new_logprobs). The engine computes every
    # token's logprob either way (RequestOutput.logprobs on the final output); this only moves them.
    logprobs: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        self.bad_words = list(self.bad_words)
        self.validate()

    def validate(
        self, num_loops: int | None = None, vocab_size: int | None = None, max_trace: int | None = None
    ) -> None:
        """Raise RequestError naming the first bad field. The engine passes its limits: the model's loops, its
        vocabulary and the longest exit_trace its decode state holds; without them only the values alone
        are checked. A request that passes with every limit given fits every fixed-size field of the
        engine's state, so no value of it can fail a step."""

        def check(ok: bool, msg: str) -> None:
            if not ok:
                raise RequestError(msg)

        check(
            _is_int(self.max_tokens) and self.max_tokens > 0,
            f"max_tokens must be a positive integer, got {self.max_tokens!r}",
        )
        check(
            _is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
            f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}",
        )
        check(
            _is_num(self.temperature) and self.temperature >= 0,
            f"temperature must be >= 0 and finite, got {self.temperature!r}",
        )
        check(_is_int(self.top_k) and self.top_k >= -1, f"top_k must be -1, 0 (off) or positive, got {self.top_k!r}")
        check(_is_num(self.top_p) and 0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p!r}")
        check(
            self.seed is None or (_is_int(self.seed) and 0 <= self.seed < 2**64),
            f"seed must be an integer in [0, 2^64), got {self.seed!r}",
        )
        check(self.ignore_eos in (True, False), f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
        check(
            isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) and s for s in self.stop),
            "stop strings must be non-empty strings",
        )
        check(
            isinstance(self.stop_token_ids, (list, tuple)) and all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids must be non-negative integers",
        )
        check(_is_int(self.min_loops) and self.min_loops >= 1, f"min_loops must be >= 1, got {self.min_loops!r}")
        check(
            self.max_loops is None or (_is_int(self.max_loops) and self.max_loops >= 1),
            f"max_loops must be >= 1, got {self.max_loops!r}",
        )
        if self.max_loops is not None:
            check(
                self.min_loops <= self.max_loops,
                f"min_loops ({self.min_loops}) must not exceed max_loops ({self.max_loops})",
            )
        check(
            self.exit_threshold is None or (_is_num(self.exit_threshold) and 0.0 <= self.exit_threshold <= 1.0),
            f"exit_threshold must be in [0, 1], got {self.exit_threshold!r}",
        )
        check(
            _is_num(self.repetition_penalty) and self.repetition_penalty > 0,
            f"repetition_penalty must be > 0 and finite (1: off), got {self.repetition_penalty!r}",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            check(_is_num(v) and -2.0 <= v <= 2.0, f"{name} must be in [-2, 2] (0: off), got {v!r}")
        check(
            all(isinstance(w, str) and w.strip() for w in self.bad_words),
            f"bad_words must be non-blank strings, got {self.bad_words!r}",
        )
        check(self.logprobs in (True, False), f"logprobs must be a boolean, got {self.logprobs!r}")
        if self.exit_trace is not None:
            check(isinstance(self.exit_trace, (list, tuple)), "exit_trace must be a list of loop depths")
            self.exit_trace = list(self.exit_trace)
            check(
                len(self.exit_trace) > 0 and all(_is_int(d) and d >= 1 for d in self.exit_trace),
                "exit_trace must be a non-empty list of loop depths >= 1",
            )
        if num_loops is not None:
            check(self.min_loops <= num_loops, f"min_loops ({self.min_loops}) exceeds the model's {num_loops} loops")
            check(
                self.max_loops is None or self.max_loops <= num_loops,
                f"max_loops ({self.max_loops}) exceeds the model's {num_loops} loops",
            )
            if self.exit_trace is not None:
                check(max(self.exit_trace) <= num_loops, f"exit_trace depths must be <= {num_loops}")
        if max_trace is not None and self.exit_trace is not None:
            check(
                len(self.exit_trace) <= max_trace,
                f"exit_trace has {len(self.exit_trace)} depths; at most {max_trace} are supported",
            )
        if vocab_size is not None:
            check(self.top_k <= vocab_size, f"top_k ({self.top_k}) exceeds the vocabulary size ({vocab_size})")
            bad = [t for t in self.stop_token_ids if t >= vocab_size]
            if bad:
                raise RequestError(f"stop_token_ids has id {bad[0]} outside the vocabulary [0, {vocab_size})")

    @property
    def penalized(self) -> bool:
        """Whether any penalty is on (the engine samples its batches with penalties only then)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def processes_logits(self) -> bool:
        """Whether sampling needs the engine's penalty state: penalties or bad words (SamplerMode.PENALIZE)."""
        return self.penalized or bool(self.bad_words)


MAX_BAD_WORDS = 32  # token sequences (two per word at most) a request's bad_words may come to
MAX_BAD_WORD_TOKENS = 8  # tokens in one of them


def bad_words_token_ids(tokenizer: Tokenizer, words: Sequence[str]) -> list[list[int]]:
    """vLLM's tokenization of bad_words: each word without leading spaces, and again with one leading space
    when that gives a different first token and as many tokens (a word inside the text). RequestError
    when they come to more than MAX_BAD_WORDS sequences or one is longer than MAX_BAD_WORD_TOKENS."""
    out: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False).ids
        if not 0 < len(plain) <= MAX_BAD_WORD_TOKENS:
            raise RequestError(f"bad word {word!r} is {len(plain)} tokens; 1 to {MAX_BAD_WORD_TOKENS} are supported")
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False).ids
        out.append(plain)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    if len(out) > MAX_BAD_WORDS:
        raise RequestError(f"bad_words come to {len(out)} token sequences; at most {MAX_BAD_WORDS} are supported")
    return out


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: object) -> bool:
    """A finite real number (a float64 can hold it)."""
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:  # an int beyond float range
        return False
