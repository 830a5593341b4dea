"""Model-free unit tier: a request's host state (`Sequence`) and stop strings (`StopChecker`).

The tokenizer is a stand-in with one fixed string per id (only `decode` is used), so every text, hold-back
and trim below is exact (tests/conftest.py, tier `unit`).
"""

from __future__ import annotations

import pytest

from ouro_backend.engine.sequence import Sequence, Status, StopChecker
from ouro_backend.outputs import FinishReason
from ouro_backend.sampling_params import SamplingParams

VOCAB = {0: "<eos>", 1: "a", 2: "b", 3: "E", 4: "N", 5: "D", 6: "xy", 7: " ", 8: "c", 9: "d"}
SPECIAL = {0}
E, N, D = 3, 4, 5


class CharTokenizer:
    """decode() as a Hugging Face tokenizer's: the ids' strings joined, special ones skipped."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(VOCAB[i] for i in ids if not (skip_special_tokens and i in SPECIAL))


TOK = CharTokenizer()


def make_seq(prompt=(1, 2, 8, 9, 1, 2, 8), stops=(), **params) -> Sequence:
    params.setdefault("max_tokens", 16)
    return Sequence("r", list(prompt), SamplingParams(**params), 7, StopChecker(list(stops)))


def feed(seq: Sequence, tokens, depth=4):
    """What LLMEngine._append does for stop strings: append, update the checker (active from min_tokens),
    and on a match record the characters to trim and finish with "stop". Returns the step of the match."""
    for tok in tokens:
        seq.append_token(tok, depth, -0.5)
        n = len(seq.output_ids)
        active = n >= seq.params.min_tokens
        if seq.stop.update(TOK, tok, active=active) and active:
            seq.trim_chars = len(seq.stop.text) - seq.stop.cut
            seq.finish(FinishReason.STOP)
            return n
    return None


# ------------------------------------------------------------------------------------------------ Sequence


def test_new_sequence_state():
    seq = make_seq(prompt=[1, 2, 3])
    assert seq.status is Status.WAITING and not seq.finished
    assert seq.slot is None and seq.block_tables == [] and seq.cached_keys == []
    assert (seq.num_prefilled, seq.prefill_target, seq.num_tokens) == (0, 3, 3)
    assert seq.in_prefill and not seq.resuming
    assert seq.prompt_keys is None and seq.num_cached_tokens == 0 and seq.num_emitted == 0
    assert seq.seed == 7 and seq.first_token_time is None and seq.finish_time is None


def test_token_ids_across_the_prompt_boundary():
    seq = make_seq(prompt=[1, 2, 3])
    for t in (7, 8, 9):
        seq.append_token(t, 2, 0.0)
    assert seq.num_tokens == 6
    assert seq.token_ids(0, 3) == [1, 2, 3]
    assert seq.token_ids(1, 2) == [2]
    assert seq.token_ids(3, 6) == [7, 8, 9]
    assert seq.token_ids(4, 5) == [8]
    assert seq.token_ids(2, 5) == [3, 7, 8]
    assert seq.token_ids(0, 6) == [1, 2, 3, 7, 8, 9]


def test_append_token_position_depth_and_resuming():
    seq = make_seq(prompt=[1, 2, 3])
    seq.append_token(8, 2, -0.25)
    t0 = seq.first_token_time
    assert t0 is not None and seq.resuming
    seq.append_token(9, 3, -1.0)
    assert seq.first_token_time == t0  # set once
    assert (seq.output_ids, seq.exit_depths, seq.logprobs) == ([8, 9], [2, 3], [-0.25, -1.0])
    # Prompt positions ran every loop; generated position i ran to the depth that produced token i + 1.
    assert [seq.position_depth(p, 4) for p in (0, 1, 2)] == [4, 4, 4]
    assert seq.position_depth(3, 4) == 3
    with pytest.raises(IndexError):
        seq.position_depth(4, 4)  # the last token's own depth is not known yet


def test_in_prefill_follows_num_prefilled_and_target():
    seq = make_seq(prompt=[1, 2, 3, 4])
    seq.num_prefilled = 3
    assert seq.in_prefill
    seq.num_prefilled = 4
    assert not seq.in_prefill
    seq.prefill_target = 6  # a recompute readmission also prefills generated tokens
    assert seq.in_prefill


def test_finish():
    seq = make_seq()
    seq.finish(FinishReason.ABORT)
    assert seq.finished and seq.status is Status.FINISHED and seq.finish_reason == "abort"
    assert seq.finish_time is not None


# -------------------------------------------------------------------------------------------- make_output


def test_make_output_deltas_and_prefix_window():
    seq = make_seq(prompt=[1, 2, 8, 9, 1, 2, 8])  # "abcdabc"
    feed(seq, [9, 7], depth=3)
    out = seq.make_output(TOK, with_text=True)
    assert out.new_token_ids == [9, 7] and out.new_exit_depths == [3, 3]
    assert out.prefix_token_ids == [8, 9, 1, 2, 8]  # the last 5 prompt ids
    assert out.new_text == "d "
    assert out.token_ids == [] and out.exit_depths == [] and out.logprobs == [] and out.text == ""
    assert not out.finished and out.finish_reason is None and out.trim_chars == 0
    assert out.prompt_token_ids == [1, 2, 8, 9, 1, 2, 8] and out.request_id == "r"
    assert seq.num_emitted == 2

    again = seq.make_output(TOK, with_text=True)  # nothing new
    assert again.new_token_ids == [] and again.new_text == "" and again.prefix_token_ids == [1, 2, 8, 9, 7]

    feed(seq, [6], depth=1)
    out = seq.make_output(TOK, with_text=False)
    assert out.new_token_ids == [6] and out.new_exit_depths == [1] and out.new_text == ""
    assert out.prefix_token_ids == [1, 2, 8, 9, 7]  # the window spans the prompt and the output
    seq.finish(FinishReason.LENGTH)
    final = seq.make_output(TOK, with_text=True)
    assert final.finished and final.finish_reason == "length"
    assert final.new_token_ids == [] and final.new_text == ""
    assert final.token_ids == [9, 7, 6] and final.exit_depths == [3, 3, 1] and final.logprobs == [-0.5] * 3
    assert final.text == "d xy"
    assert seq.num_emitted == 3


def test_short_prompt_prefix_window():
    seq = make_seq(prompt=[1])
    feed(seq, [2])
    assert seq.make_output(TOK, True).prefix_token_ids == [1]


def test_final_output_skips_special_tokens_in_text():
    seq = make_seq(prompt=[1])
    feed(seq, [2, 0])
    seq.finish(FinishReason.STOP)
    out = seq.make_output(TOK, with_text=True)
    assert out.token_ids == [2, 0] and out.text == "b" and out.new_text == "b"


def test_error_output_carries_only_what_was_emitted():
    seq = make_seq()
    feed(seq, [1, 2])
    seq.make_output(TOK, True)
    feed(seq, [8])
    err = seq.error_output("engine error: boom")
    assert err.finished and err.finish_reason == "error" and err.error == "engine error: boom"
    assert err.token_ids == [1, 2] and err.exit_depths == [4, 4] and err.text == ""


# ------------------------------------------------------------------------------------------- StopChecker


def test_stop_checker_without_stops():
    sc = StopChecker([])
    assert sc.max_len == 0
    assert sc.update(TOK, 1) is False
    assert sc.text == "" and sc.token_ends == [] and sc.detok is None  # nothing tracked
    assert sc.safe_tokens() == 1 << 62
    assert sc.text_for_output(TOK, [1, 2, 0]) == "ab"


def test_stop_checker_holds_back_what_may_start_a_stop_string():
    sc = StopChecker(["END", "xy"])
    assert sc.max_len == 3
    steps = []
    for tok in (1, 2, E, N, D):
        hit = sc.update(TOK, tok)
        steps.append((hit, sc.text, list(sc.token_ends), sc.safe_tokens(), sc.cut))
    assert steps == [
        (False, "a", [1], 0, None),  # safe: tokens whose text ends at or before len(text) - (max_len - 1)
        (False, "ab", [1, 2], 0, None),
        (False, "abE", [1, 2, 3], 1, None),
        (False, "abEN", [1, 2, 3, 4], 2, None),
        (True, "abEND", [1, 2, 3, 4, 5], 3, 2),
    ]
    assert sc.text_for_output(TOK, [1, 2, E, N, D]) == "ab"


def test_stop_checker_finds_the_earliest_of_several_stops():
    sc = StopChecker(["Nd", "END"])
    for tok in (1, E, N):
        assert not sc.update(TOK, tok)
    assert sc.update(TOK, 9)  # "aENd": "Nd" at 2; "END" is not there
    assert sc.cut == 2
    sc2 = StopChecker(["ND", "EN"])
    for tok in (1, E):
        assert not sc2.update(TOK, tok)
    assert sc2.update(TOK, N) and sc2.cut == 1  # "EN" at 1


def test_stop_string_inside_one_token():
    sc = StopChecker(["y"])
    assert not sc.update(TOK, 1)
    assert sc.update(TOK, 6)  # "axy": the match is in the middle of the last token
    assert sc.cut == 2 and sc.text_for_output(TOK, [1, 6]) == "ax"


def test_inactive_updates_track_text_but_do_not_match():
    """Before min_tokens the text is tracked, not searched; a later search starts max_len - 1 characters
    before the new text, so a stop string completed while inactive is never found, and one that is
    completed by the first active token is."""
    sc = StopChecker(["END"])
    for tok in (E, N, D):
        assert sc.update(TOK, tok, active=False) is False
    assert sc.text == "END" and sc.cut is None
    assert sc.update(TOK, 1) is False and sc.cut is None  # "ENDa": search from 1

    sc = StopChecker(["END"])
    assert not sc.update(TOK, E, active=False)
    assert not sc.update(TOK, N, active=False)
    assert sc.update(TOK, D) is True and sc.cut == 0


def test_min_tokens_through_the_engine_rule():
    seq = make_seq(prompt=[1], stops=["END"], min_tokens=4)
    assert feed(seq, [E, N, D]) is None  # matched while inactive: ignored
    assert feed(seq, [1, E, N, D]) == 7
    assert seq.finished and seq.trim_chars == 3 and seq.stop.cut == 4


def test_stop_string_hold_back_and_trim_in_outputs():
    seq = make_seq(prompt=[8], stops=["END"])
    feed(seq, [1, 2])
    out = seq.make_output(TOK, with_text=True)
    # The last max_len - 1 = 2 characters are held back whatever they are: "ab" waits.
    assert out.new_token_ids == [] and out.new_text == ""
    feed(seq, [E])
    out = seq.make_output(TOK, with_text=True)
    assert out.new_token_ids == [1] and out.new_text == "a"
    feed(seq, [N])
    out = seq.make_output(TOK, with_text=True)
    assert out.new_token_ids == [2] and out.new_text == "b" and out.prefix_token_ids == [8, 1]
    assert feed(seq, [D]) == 5
    assert seq.trim_chars == 3
    final = seq.make_output(TOK, with_text=True)
    assert final.finished and final.finish_reason == "stop"
    assert final.new_token_ids == [E, N, D] and final.new_text == ""  # "END" trimmed off the delta
    assert final.trim_chars == 3 and final.text == "ab"
    assert final.token_ids == [1, 2, E, N, D]  # the stop string's tokens stay in the ids


def test_trim_keeps_text_before_the_match_in_the_last_tokens():
    seq = make_seq(prompt=[8], stops=["END"])
    feed(seq, [1])
    assert seq.make_output(TOK, True).new_token_ids == []
    feed(seq, [9, E, N])
    out = seq.make_output(TOK, True)
    assert out.new_token_ids == [1, 9] and out.new_text == "ad"
    feed(seq, [D, 1])  # finishes on D: the trailing 1 is never appended
    final = seq.make_output(TOK, True)
    assert final.new_token_ids == [E, N, D] and final.trim_chars == 3 and final.new_text == ""
    assert final.text == "ad" and final.token_ids == [1, 9, E, N, D]
