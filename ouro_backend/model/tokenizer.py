"""Tokenizer loading and streaming (incremental) detokenization.

Why not decode each new token alone: byte-level BPE tokens are byte pieces, so one token can be half of a
UTF-8 character ("🙂" may be 2-4 tokens) and decoders may treat a sequence's first token specially
(leading spaces). The classic fix: decode(prefix + new) minus decode(prefix), with a few tokens of
prefix, and hold back a trailing incomplete character (U+FFFD) until a later token completes it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ..outputs import PREFIX_WINDOW
from .checkpoint import CheckpointError

REPLACEMENT = "\ufffd"  # what lossy UTF-8 decoding gives for an incomplete (or invalid) byte sequence


SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 as in Ouro


def train_byte_level_bpe(texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> str:
    """A byte-level BPE tokenizer (GPT-2 style, like Ouro's) with Ouro's special tokens first, as JSON.
    Deterministic: the trainer breaks count ties by pair ids, and the byte alphabet is fixed."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        show_progress=False,
        special_tokens=SPECIAL_TOKENS,  # first: ids 0, 1, 2
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # every byte encodable
    tok.train_from_iterator(texts, trainer)
    return tok.to_str()


def load_tokenizer(model_dir: str | os.PathLike) -> Tokenizer:
    path = Path(model_dir).expanduser() / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(f"{path} not found: the engine needs a Hugging Face fast tokenizer (tokenizer.json)")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:
        raise CheckpointError(f"cannot load {path}: {e}") from None


def _delta(
    tokenizer: Tokenizer, prefix_ids: Sequence[int], new_ids: Sequence[int], skip_special_tokens: bool, final: bool
) -> tuple[str, bool]:
    """(new text, whether one trailing U+FFFD was held back)."""
    prefix_text = tokenizer.decode(list(prefix_ids), skip_special_tokens=skip_special_tokens)
    full = tokenizer.decode(list(prefix_ids) + list(new_ids), skip_special_tokens=skip_special_tokens)
    # The prefix's own trailing U+FFFD was held back when it was new: its (maybe completed) character
    # belongs to this delta.
    start = len(prefix_text) - prefix_text.endswith(REPLACEMENT)
    held = not final and full.endswith(REPLACEMENT)
    # Lossy UTF-8 gives exactly one U+FFFD for an incomplete tail; earlier ones are permanent (invalid
    # bytes or a real U+FFFD), so holding back one character is always enough and never loses text.
    return full[start : len(full) - held], held


def decode_delta(
    tokenizer: Tokenizer,
    prefix_ids: Sequence[int],
    new_ids: Sequence[int],
    skip_special_tokens: bool = True,
    final: bool = False,
) -> str:
    """Stateless streaming step: the text `new_ids` add after `prefix_ids` (the last ~PREFIX_WINDOW ids
    already streamed; they are context only). Semantics: decode(prefix + new)[len(decode(prefix)):], except
    that a trailing U+FFFD (a possibly incomplete character) is never emitted: it is dropped from the
    result, and the next call, whose prefix ends with these ids, emits it (completed, or as U+FFFD if it
    stays invalid). Pass final=True on a stream's last chunk to emit everything. So the concatenation of
    all deltas equals tokenizer.decode(all_ids) exactly. `decode_delta(...) == ''` with new ids means
    "nothing complete yet", not "no text"."""
    return _delta(tokenizer, prefix_ids, new_ids, skip_special_tokens, final)[0]


class IncrementalDetokenizer:
    """Per-stream detokenizer: `add(ids)` returns the text those ids add, `flush()` what is still held back.

    `prompt_ids` (optional) only give the first generated tokens their left context; their text is not
    returned. Memory is O(PREFIX_WINDOW): only the last few ids are kept.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
        window: int = PREFIX_WINDOW,
    ) -> None:
        assert window >= 4, "window must cover an incomplete UTF-8 tail (3 tokens) plus one"
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.window = window
        self.prefix: list[int] = list(prompt_ids)[-window:]
        # A prompt ending mid-character: the character the first tokens complete is part of the first
        # delta (the prompt's text stops before it), so nothing is pending yet.
        self.held = False
        self.num_tokens = 0

    def add(self, ids: int | Iterable[int]) -> str:
        new = [ids] if isinstance(ids, int) else list(ids)
        if not new:
            return ""
        text, self.held = _delta(self.tokenizer, self.prefix, new, self.skip_special_tokens, final=False)
        self.prefix = (self.prefix + new)[-self.window :]
        self.num_tokens += len(new)
        return text

    def flush(self) -> str:
        """End of stream: the held-back U+FFFD, if any (the full decode ends with it too)."""
        held, self.held = self.held, False
        return REPLACEMENT if held else ""
