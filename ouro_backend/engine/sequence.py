"""A request's host-side state inside the engine (the scheduler owns it; no device tensors here)."""

from __future__ import annotations

import enum
import time

from ..model.tokenizer import PREFIX_WINDOW, IncrementalDetokenizer, decode_delta
from ..outputs import FinishReason, RequestOutput
from ..sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted: its KV and decode row wait in host memory (docs/kv-memory.md)
    FINISHED = "finished"


class Sequence:
    def __init__(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, seed: int, stop_checker: StopChecker
    ):
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.seed = seed  # sampling noise is a function of (seed, token index): see sampler.py
        self.status = Status.WAITING
        self.slot: int | None = None  # the row of the runner's decode state, while running
        self.output_ids: list[int] = []
        self.exit_depths: list[int] = []
        self.logprobs: list[float] = []
        self.block_tables: list[list[int]] = []
        self.num_prefilled = 0  # prompt tokens that have completed all loops (or are completing now)
        # Tokens to prefill: the prompt, or after a recompute preemption the prompt and the generated tokens
        # before the last one (each at its recorded exit depth; docs/kv-memory.md).
        self.prefill_target = len(prompt_ids)
        # Prefix caching: the chained keys of the prompt's full blocks, the entries this request holds a
        # reference on (its first len(cached_keys) blocks of every plane are theirs), and how many prompt
        # tokens its first admission found cached.
        self.prompt_keys: list[bytes] | None = None
        self.cached_keys: list[bytes] = []
        self.num_cached_tokens = 0
        self.finish_reason: FinishReason | None = None
        self.stop = stop_checker
        self.bad_word_ids: list[list[int]] = []  # params.bad_words tokenized (sampling_params.bad_words_token_ids)
        self.num_emitted = 0  # output tokens already handed out in a RequestOutput
        self.spec_drafted = self.spec_accepted = 0  # self-speculation: draft tokens proposed / accepted
        self.trim_chars = 0
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without building the concatenation."""
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        if start >= p:
            return self.output_ids[start - p : end - p]
        return self.prompt_ids[start:] + self.output_ids[: end - p]

    @property
    def in_prefill(self) -> bool:
        return self.num_prefilled < self.prefill_target

    @property
    def ends_with_its_prompt(self) -> bool:
        """A fresh request allowed one token: the prompt's last loop makes it, and nothing is left to decode."""
        return self.params.max_tokens == 1 and not self.output_ids

    @property
    def resuming(self) -> bool:
        """Readmitted after a recompute preemption (it has tokens): its prefill ends on a token it already
        has, which is not sampled again."""
        return bool(self.output_ids)

    def position_depth(self, pos: int, num_loops: int) -> int:
        """The loop depth position `pos` ran to: the prompt's run every loop; a generated token's input position
        ran to the depth that produced the next token."""
        return num_loops if pos < len(self.prompt_ids) else self.exit_depths[pos - len(self.prompt_ids) + 1]

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def finish(self, reason: FinishReason) -> None:
        """Tokens the device produced for this request after this point are dropped when read back."""
        self.status = Status.FINISHED
        self.finish_reason = reason
        self.finish_time = time.monotonic()

    def append_token(self, token: int, depth: int, logprob: float) -> None:
        """A sampled token, read back from the device."""
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        self.output_ids.append(token)
        self.exit_depths.append(depth)
        self.logprobs.append(logprob)

    def make_output(self, tokenizer, with_text: bool) -> RequestOutput:
        """The delta since the last output (holding back possible stop text); the final output also carries
        the whole stream."""
        done = self.finished
        end = len(self.output_ids) if done else min(len(self.output_ids), self.stop.safe_tokens())
        start = self.num_emitted
        first_new = len(self.prompt_ids) + start
        prefix = self.token_ids(max(0, first_new - PREFIX_WINDOW), first_new)
        new_ids = self.output_ids[start:end]
        new_text = ""
        text = self.stop.text_for_output(tokenizer, self.output_ids) if done else ""
        if with_text and new_ids:
            new_text = decode_delta(tokenizer, prefix, new_ids, final=done)
            if done and self.trim_chars:
                new_text = new_text[: len(new_text) - self.trim_chars]
        # The whole stream only on the final output: copying it every token would be O(n^2) per request.
        out = RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_ids,
            token_ids=list(self.output_ids) if done else [],
            exit_depths=list(self.exit_depths) if done else [],
            logprobs=list(self.logprobs) if done else [],
            text=text,
            finished=self.finished,
            finish_reason=self.finish_reason.value if self.finish_reason else None,
            new_token_ids=new_ids,
            new_exit_depths=self.exit_depths[start : start + len(new_ids)],
            new_logprobs=self.logprobs[start : start + len(new_ids)] if self.params.logprobs else [],
            new_text=new_text,
            prefix_token_ids=prefix,
            trim_chars=self.trim_chars if self.finished and new_ids else 0,
            num_cached_tokens=self.num_cached_tokens,
            arrival_time=self.arrival_time,
            first_token_time=self.first_token_time,
            finish_time=self.finish_time,
            num_spec_drafted=self.spec_drafted,
            num_spec_accepted=self.spec_accepted,
        )
        self.num_emitted = max(start, end)  # only once the output exists: a failure above hands out nothing
        return out

    def error_output(self, message: str) -> RequestOutput:
        """The final output of a request that failed: the tokens already handed out (what its deltas add up
        to), no text (detokenizing may be what failed), finish_reason "error" and the message."""
        n = self.num_emitted
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_ids,
            token_ids=self.output_ids[:n],
            exit_depths=self.exit_depths[:n],
            logprobs=self.logprobs[:n],
            text="",
            finished=True,
            finish_reason=FinishReason.ERROR.value,
            error=message,
            num_cached_tokens=self.num_cached_tokens,
            arrival_time=self.arrival_time,
            first_token_time=self.first_token_time,
            finish_time=self.finish_time,
            num_spec_drafted=self.spec_drafted,
            num_spec_accepted=self.spec_accepted,
        )


class StopChecker:
    """Stop strings on the generated text: find matches and hold back text that may start one."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.max_len = max((len(s) for s in stops), default=0)
        self.text = ""
        self.token_ends: list[int] = []  # text length after each output token
        self.cut: int | None = None  # match position in text
        self.detok: IncrementalDetokenizer | None = None

    def update(self, tokenizer, token: int, active: bool = True) -> bool:
        """Call after every new token; True when a stop string matched. While not `active` (before
        min_tokens) the text is tracked but not searched, as in vLLM."""
        if not self.stops:
            return False
        if self.detok is None:
            self.detok = IncrementalDetokenizer(tokenizer)
        prev = len(self.text)
        self.text += self.detok.add(token)  # an incomplete trailing character is held back
        self.token_ends.append(len(self.text))
        if not active:
            return False
        start = max(0, prev - self.max_len + 1)
        hits = [i for i in (self.text.find(stop, start) for stop in self.stops) if i >= 0]
        if hits:
            self.cut = min(hits)
        return self.cut is not None

    def safe_tokens(self) -> int:
        """How many output tokens can be emitted without risking text of a stop string."""
        if not self.stops:
            return 1 << 62
        limit = len(self.text) - (self.max_len - 1)
        n = 0
        while n < len(self.token_ends) and self.token_ends[n] <= limit:
            n += 1
        return n

    def text_for_output(self, tokenizer, output_ids: list[int]) -> str:
        return self.text[: self.cut] if self.cut is not None else tokenizer.decode(output_ids)
