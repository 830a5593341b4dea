"""What the engine hands back: one `RequestOutput` per request that made progress in a step."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

# `prefix_token_ids` holds up to this many ids: the detokenization context of `new_token_ids`.
PREFIX_WINDOW = 5  # >= 4: an incomplete UTF-8 tail is at most 3 bytes, so at most 3 tokens


class FinishReason(str, enum.Enum):
    """Why a request ended. `RequestOutput.finish_reason` carries the value (a plain string)."""

    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens
    ABORT = "abort"  # aborted by its client
    ERROR = "error"  # the engine ended it with an error (`RequestOutput.error`)

    def __str__(self) -> str:
        return self.value


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    # On the final output: the whole stream, the loop depth that produced each token and its logprob
    # (empty on intermediate outputs, which carry only the new_* delta, like vLLM's DELTA outputs).
    token_ids: list[int]
    exit_depths: list[int]
    logprobs: list[float]
    text: str  # on the final output: detokenized, special tokens skipped, cut at a matched stop string
    finished: bool = False
    finish_reason: str | None = None  # a FinishReason value: "stop" | "length" | "abort" | "error"
    # The part of the stream that is new since the previous output for this request. Tokens that might
    # still turn into a stop string are held back until that is decided.
    new_token_ids: list[int] = field(default_factory=list)
    new_exit_depths: list[int] = field(default_factory=list)
    # The new tokens' logprobs when the request asked for them (SamplingParams.logprobs), else empty.
    new_logprobs: list[float] = field(default_factory=list)
    new_text: str = ""
    # Up to 5 token ids just before new_token_ids (prompt ids at the start of a stream), so a stateless
    # detokenizer can produce new_text as decode(prefix + new) - decode(prefix).
    prefix_token_ids: list[int] = field(default_factory=list)
    # Characters to drop from the end of decode(prefix + new) - decode(prefix): non-zero only on the final
    # output when a stop string matched inside the last tokens.
    trim_chars: int = 0
    # finish_reason "error": why the engine ended this request (docs/engine.md, "Failure isolation"); the
    # other requests of the step are unaffected.
    error: str | None = None
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (as vLLM reports)
    # Timing (time.monotonic()): arrival, first token, finish.
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    # Self-speculation (spec_tokens > 0): draft tokens proposed for this request so far, and how many of
    # them verification accepted.
    num_spec_drafted: int = 0
    num_spec_accepted: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)
