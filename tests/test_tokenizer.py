import random

import pytest
from tokenizers import Tokenizer

from ouro_backend.config import ConfigError
from ouro_backend.model.checkpoint import CheckpointError
from ouro_backend.model.tokenizer import (
    PREFIX_WINDOW,
    REPLACEMENT,
    IncrementalDetokenizer,
    decode_delta,
    load_tokenizer,
)
from ouro_backend.model.toy import build_tokenizer_json, write_checkpoint

TEXTS = [
    "héllo wörld 你好 🙂",
    "  leading spaces,  double  spaces and a trailing one ",
    "rare: 🦀 龘 ŋ ẞ 𝄞 ꙮ 🧬🧬 — ñandú",  # characters not in the corpus: split into byte tokens
    "mixed\ttabs\nnew lines\n\n  indented 你好世界 😀😂 end",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_str(build_tokenizer_json())


def stream(tok, ids, chunk_sizes=None, **kw) -> list[str]:
    detok = IncrementalDetokenizer(tok, **kw)
    deltas, i = [], 0
    while i < len(ids):
        n = chunk_sizes.pop(0) if chunk_sizes else 1
        deltas.append(detok.add(ids[i : i + n] if n > 1 else ids[i]))
        i += n
    deltas.append(detok.flush())
    return deltas


def test_multibyte_is_split_across_tokens(tok):
    # Guards the tests below: they only mean something if single tokens are partial characters.
    ids = tok.encode(TEXTS[2]).ids
    assert any(REPLACEMENT in tok.decode([i]) for i in ids)
    assert "".join(tok.decode([i]) for i in ids) != TEXTS[2]  # the classic per-token bug


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_is_exact(tok, text):
    ids = tok.encode(text).ids
    assert tok.decode(ids) == text
    deltas = stream(tok, ids)
    assert "".join(deltas) == text
    assert not any(REPLACEMENT in d for d in deltas)  # never a partial character on the wire
    assert deltas[0] == text[: len(deltas[0])] and len(deltas[0]) > 0  # leading spaces kept


@pytest.mark.parametrize("text", TEXTS)
def test_random_chunks_are_exact(tok, text):
    ids = tok.encode(text).ids
    rng = random.Random(0)
    for _ in range(20):
        sizes = [rng.randint(1, 4) for _ in range(len(ids))]
        assert "".join(stream(tok, ids, sizes)) == text


def test_decode_delta_matches_stateful(tok):
    ids = tok.encode(" ".join(TEXTS)).ids
    detok = IncrementalDetokenizer(tok)
    stateless = []
    for i, t in enumerate(ids):
        prefix = ids[max(0, i - PREFIX_WINDOW) : i]
        d = decode_delta(tok, prefix, [t], final=i == len(ids) - 1)
        stateless.append(d)
        assert d == detok.add(t) + (detok.flush() if i == len(ids) - 1 else "")
    assert "".join(stateless) == " ".join(TEXTS)


def test_fuzz_random_ids_including_invalid_utf8(tok):
    # Random byte tokens make invalid and truncated UTF-8: U+FFFD that is permanent must still come out.
    rng = random.Random(1)
    vocab = tok.get_vocab_size()
    for _ in range(150):
        ids = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 25))]
        full = tok.decode(ids)
        assert "".join(stream(tok, ids)) == full
        assert "".join(stream(tok, ids, [rng.randint(1, 5) for _ in ids])) == full
        out = [
            decode_delta(tok, ids[max(0, i - PREFIX_WINDOW) : i], [ids[i]], final=i == len(ids) - 1)
            for i in range(len(ids))
        ]
        assert "".join(out) == full


def test_incomplete_tail_is_held_then_flushed(tok):
    ids = tok.encode("a🦀").ids
    cut = ids[:-1]  # the crab's last byte missing
    assert tok.decode(cut).endswith(REPLACEMENT)
    detok = IncrementalDetokenizer(tok)
    text = "".join(detok.add(i) for i in cut)
    assert text == "a"
    assert detok.flush() == REPLACEMENT
    assert decode_delta(tok, [], cut) == "a"
    assert decode_delta(tok, [], cut, final=True) == "a" + REPLACEMENT
    # completing the character later emits it whole
    assert decode_delta(tok, cut, ids[-1:]) == "🦀"


def test_real_replacement_characters_are_not_lost(tok):
    text = "x\ufffd\ufffd y \ufffd"
    ids = tok.encode(text).ids
    assert "".join(stream(tok, ids)) == text


def test_special_tokens(tok):
    ids = tok.encode("hi").ids + [2] + tok.encode(" there").ids
    assert [tok.id_to_token(i) for i in (0, 1, 2)] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert "".join(stream(tok, ids)) == "hi there"
    assert "".join(stream(tok, ids, skip_special_tokens=False)) == "hi<|im_end|> there"


def test_prompt_context(tok):
    prompt = tok.encode("Bonjour, ").ids
    gen = tok.encode("très bien 🙂").ids
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    out = "".join(detok.add(i) for i in gen) + detok.flush()
    assert out == tok.decode(prompt + gen)[len(tok.decode(prompt)) :] == "très bien 🙂"
    assert detok.num_tokens == len(gen)


def test_load_tokenizer(tmp_path):
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot load"):
        load_tokenizer(tmp_path)
    write_checkpoint(tmp_path / "toy")
    assert load_tokenizer(tmp_path / "toy").decode(load_tokenizer(tmp_path / "toy").encode("né").ids) == "né"
