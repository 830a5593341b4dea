"""Model-free unit tier: the engine process's wire (`engine_messages.encode` / `decode`): every step's
`Outputs` as a binary frame, equal to what was sent field for field; what the frame cannot hold is pickled
instead; bytes that are not a message are refused."""

from __future__ import annotations

import struct

import pytest

from ouro_backend.sampling_params import SamplingParams
from ouro_backend.serving.engine_messages import (
    AbortRequest,
    AddRequest,
    Delta,
    Failed,
    Load,
    LoadReport,
    Outputs,
    Rejected,
    decode,
    encode,
)

DELTAS = [
    Delta("a", [5], [1], [1, 2, 3, 4, 5], 0, None),  # a first delta: with its detokenization context
    Delta("b-é-✓", [6, 7, 8], [2, 4, 3], [], 0, None, (12, 9), 16),  # speculation counts, cached prompt
    Delta("c", [], [], [], 0, "abort"),  # no tokens, finished
    Delta("d", [2**31 - 1], [4], [], 3, "stop"),  # a stop string's trim
    Delta("e", [0, 1], [1, 1], [], 0, "length"),
    Delta("f", [9], [4], [], 0, "error"),
    Delta("g", [3, 4], [4, 2], [], 0, None, (0, 0), 0, [-0.5, -1.25]),  # logprobs (exact in fp32)
    Delta("h", [7], [4], [], 0, "stop", (0, 0), 0, [-3.0]),  # ... with a finish reason in the same byte
]


def test_outputs_travel_as_a_binary_frame_and_come_back_equal():
    msg = Outputs(DELTAS, Load(17, 0.625))
    buf = encode(msg)
    assert buf[:1] == b"O", "Outputs are framed, not pickled"
    assert decode(buf) == msg
    empty = Outputs([], Load(0, 0.0))
    assert decode(encode(empty)) == empty
    # Logprobs cost a request that did not ask nothing: 4 bytes per token for one that did.
    plain = [Delta("a", [5, 6], [1, 1], [], 0, None)]
    with_lp = [plain[0]._replace(logprobs=[-1.0, -2.0])]
    assert len(encode(Outputs(with_lp, Load(0, 0.0)))) == len(encode(Outputs(plain, Load(0, 0.0)))) + 8


@pytest.mark.parametrize(
    "delta",
    [
        Delta("has\0nul", [1], [1], [], 0, None),  # the frame joins request ids with NUL
        Delta("r", [1], [1], [], 0, "because"),  # not a finish reason the frame knows
        Delta("r", [1], [300], [], 0, None),  # a depth beyond a byte
        Delta("r", [2**31], [1], [], 0, None),  # a token id beyond int32
        Delta("r", [1, 2], [1], [], 0, None),  # ids and depths of different lengths
        Delta("r", [1], [1], [], 0, None, (0, 0), 0, [-1.0, -2.0]),  # not one logprob per token
    ],
)
def test_what_the_frame_cannot_hold_is_pickled_unchanged(delta):
    msg = Outputs([DELTAS[0], delta], Load(2, 0.5))
    buf = encode(msg)
    assert buf[:1] == b"P"
    assert decode(buf) == msg


def test_other_messages_are_pickled():
    for msg in (
        AddRequest("r", [1, 2], SamplingParams(max_tokens=3)),
        AbortRequest("r"),
        Rejected("r", "bad", "invalid"),
        Failed(["r", "s"], "engine error"),
        LoadReport(Load(3, 0.1)),
    ):
        buf = encode(msg)
        assert buf[:1] == b"P" and decode(buf) == msg


def test_bytes_that_are_not_a_message_are_refused():
    with pytest.raises(ValueError, match="not a message"):
        decode(b"Xjunk")
    with pytest.raises(ValueError, match="not a message"):
        decode(b"")
    frame = encode(Outputs(DELTAS, Load(1, 0.0)))
    with pytest.raises((ValueError, struct.error)):
        decode(frame[:-3])  # cut short
    with pytest.raises(ValueError, match="malformed"):
        decode(frame + b"\0")  # trailing bytes
