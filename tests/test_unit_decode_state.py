"""Model-free unit tier: the decode state on a 3-slot CPU state (tests/conftest.py, tier `unit`): its host
packing (`DecodeState.host_row`), the host's row writes (`admit`, `release`, `activate`, `extend_tables`,
`save_row` / `restore_row`), its reads (`kv_slots_at`, `trace_depth`, `sampling_rows`) and the round
transitions (`advance`, `emit_first`, `restart_at_loop_one`) with the exact next state and record."""

from __future__ import annotations

import pytest
import torch

from ouro_backend.config import ExitMode
from ouro_backend.engine import decode_state as ds
from ouro_backend.engine.decode_state import COLUMNS, MAX_TRACE, NUM_FLOATS, NUM_INTS, DecodeState, NewRow
from ouro_backend.sampling_params import SamplingParams

T, MAX_BLOCKS, EOS = 4, 3, 7
TABLES = [[1, 2], [3, 4], [5], [6, 7]]


def row(slot=1, prompt_len=5, params=None, max_loops=3, threshold=0.7, seed=42, tables=TABLES, resume=None):
    params = params or SamplingParams(
        max_tokens=9, min_tokens=2, temperature=0.5, top_k=3, top_p=0.9, min_loops=2, max_loops=3, ignore_eos=True
    )
    return NewRow(slot, prompt_len, params, max_loops, threshold, seed, tables, resume)


def ints_by_name(ints):
    return dict(zip(list(COLUMNS)[:NUM_INTS], ints))


def test_columns_name_the_int_columns_first_in_order():
    names = list(COLUMNS)
    assert names[:NUM_INTS] == [
        "ACTIVE",
        "TOKEN",
        "POS",
        "LOOP",
        "NGEN",
        "PENDING",
        "MIN_LOOPS",
        "MAX_LOOPS",
        "MAX_TOKENS",
        "MIN_TOKENS",
        "IGNORE_EOS",
        "TOP_K",
        "SEED",
        "TRACE_LEN",
    ]
    assert [COLUMNS[n] for n in names[:NUM_INTS]] == list(range(NUM_INTS))
    assert names[NUM_INTS:] == ["THRESHOLD", "TEMPERATURE", "TOP_P"]
    assert [COLUMNS[n] for n in names[NUM_INTS:]] == list(range(NUM_FLOATS))
    assert (NUM_INTS, NUM_FLOATS, MAX_TRACE) == (14, 3, 64)


def test_host_row_values():
    ints, floats, trace, tables = DecodeState.host_row(row(), T, MAX_BLOCKS)
    assert ints == [0, 0, 4, 1, 0, 0, 2, 3, 9, 2, 1, 3, 42, 1]
    assert ints_by_name(ints) == dict(
        ACTIVE=0,
        TOKEN=0,
        POS=4,
        LOOP=1,
        NGEN=0,
        PENDING=0,
        MIN_LOOPS=2,
        MAX_LOOPS=3,
        MAX_TOKENS=9,
        MIN_TOKENS=2,
        IGNORE_EOS=1,
        TOP_K=3,
        SEED=42,
        TRACE_LEN=1,
    )
    assert floats == [0.7, 0.5, 0.9]
    assert trace == [3] + [1] * (MAX_TRACE - 1)  # no exit_trace: one depth, max_loops
    assert tables == [1, 2, 0, 3, 4, 0, 5, 0, 0, 6, 7, 0]  # num_loops x max_blocks, zero padded


def test_host_row_defaults():
    ints, floats, trace, _ = DecodeState.host_row(row(params=SamplingParams(), max_loops=4, threshold=1), T, MAX_BLOCKS)
    assert ints_by_name(ints) == dict(
        ACTIVE=0,
        TOKEN=0,
        POS=4,
        LOOP=1,
        NGEN=0,
        PENDING=0,
        MIN_LOOPS=1,
        MAX_LOOPS=4,
        MAX_TOKENS=16,
        MIN_TOKENS=0,
        IGNORE_EOS=0,
        TOP_K=0,
        SEED=42,
        TRACE_LEN=1,
    )
    assert floats == [1.0, 1.0, 1.0] and all(isinstance(f, float) for f in floats)
    assert trace[0] == 4


def test_host_row_resume_starts_at_the_last_token():
    ints, *_ = DecodeState.host_row(row(prompt_len=5, resume=(17, 3)), T, MAX_BLOCKS)
    c = ints_by_name(ints)
    assert (c["TOKEN"], c["POS"], c["NGEN"], c["LOOP"], c["ACTIVE"]) == (17, 7, 3, 1, 0)


@pytest.mark.parametrize(
    "seed, stored", [(0, 0), (2**63 - 1, 2**63 - 1), (2**63, -(2**63)), (2**64 - 1, -1), (2**64 + 5, 5)]
)
def test_host_row_seed_is_stored_as_signed_64_bits(seed, stored):
    ints, *_ = DecodeState.host_row(row(seed=seed), T, MAX_BLOCKS)
    assert ints[ds.SEED] == stored


def test_host_row_exit_trace_and_table_truncation():
    p = SamplingParams(exit_trace=[1, 3, 2])
    ints, _, trace, tables = DecodeState.host_row(row(params=p, tables=[[1, 2, 3, 4]] * T), T, MAX_BLOCKS)
    assert ints[ds.TRACE_LEN] == 3 and trace[:4] == [1, 3, 2, 1] and len(trace) == MAX_TRACE
    assert tables == [1, 2, 3] * T  # a table longer than max_blocks is cut


def test_host_row_refuses_values_that_do_not_fit():
    with pytest.raises(ValueError, match="exit_trace has 65 depths; at most 64"):
        DecodeState.host_row(row(params=SamplingParams(exit_trace=[1] * 65)), T, MAX_BLOCKS)
    with pytest.raises(ValueError, match=r"MAX_TOKENS \(9223372036854775808\) does not fit"):
        DecodeState.host_row(row(params=SamplingParams(max_tokens=2**63)), T, MAX_BLOCKS)
    with pytest.raises(ValueError, match=r"TOP_K \(9223372036854775808\)"):
        DecodeState.host_row(row(params=SamplingParams(top_k=2**63)), T, MAX_BLOCKS)


def _state() -> DecodeState:
    return DecodeState(
        num_slots=3,
        num_loops=T,
        max_blocks=MAX_BLOCKS,
        hidden_size=2,
        dtype=torch.float32,
        device=torch.device("cpu"),
        block_size=4,
        last_exited=True,
        eos_ids=[EOS],
    )


def _admit(st: DecodeState, rows: list[NewRow]):
    packed = [DecodeState.host_row(r, T, MAX_BLOCKS) for r in rows]
    cat = lambda i: [v for p in packed for v in p[i]]  # noqa: E731
    st.admit(
        torch.tensor([r.slot for r in rows]),
        torch.tensor(cat(0), dtype=torch.int64),
        torch.tensor(cat(1), dtype=torch.float64),
        torch.tensor(cat(2), dtype=torch.int64),
        torch.tensor(cat(3), dtype=torch.int32),
    )


def test_state_shapes():
    st = _state()
    assert tuple(st.ints.shape) == (3, NUM_INTS) and st.ints.dtype == torch.int64
    assert tuple(st.floats.shape) == (3, NUM_FLOATS) and st.floats.dtype == torch.float64
    assert tuple(st.trace.shape) == (3, MAX_TRACE) and tuple(st.tables.shape) == (3, T, MAX_BLOCKS)
    assert st.tables.dtype == torch.int32 and tuple(st.hidden.shape) == (3, 2)
    assert tuple(st.new_record(2).shape) == (2, 4, 3) and st.new_record().dtype == torch.float32


def test_admit_writes_only_the_given_slots_and_release_switches_rows_off():
    st = _state()
    st.remaining.fill_(0.25)
    a = row(slot=2, prompt_len=5, tables=[[1, 2], [3, 4], [5, 6], [7, 8]])
    b = row(
        slot=0,
        prompt_len=3,
        params=SamplingParams(max_tokens=4, temperature=0.0, exit_trace=[2, 4]),
        max_loops=4,
        threshold=0.5,
        seed=9,
        tables=[[9], [10], [11], [12]],
        resume=(33, 2),
    )
    _admit(st, [a, b])
    assert st.ints.tolist() == [
        [0, 33, 4, 1, 2, 0, 1, 4, 4, 0, 0, 0, 9, 2],  # slot 0: b, resumed at its token 33
        [0] * NUM_INTS,  # slot 1: untouched
        [0, 0, 4, 1, 0, 0, 2, 3, 9, 2, 1, 3, 42, 1],  # slot 2: a
    ]
    assert st.floats.tolist() == [[0.5, 0.0, 1.0], [0.0, 0.0, 0.0], [0.7, 0.5, 0.9]]
    assert st.remaining.tolist() == [1.0, 0.25, 1.0]
    assert st.trace[:, :3].tolist() == [[2, 4, 1], [1, 1, 1], [3, 1, 1]]
    assert st.tables.tolist() == [
        [[9, 0, 0], [10, 0, 0], [11, 0, 0], [12, 0, 0]],
        [[0, 0, 0]] * T,
        [[1, 2, 0], [3, 4, 0], [5, 6, 0], [7, 8, 0]],
    ]
    # Rows are admitted inactive (their prompt's last chunk activates them); say they became active.
    st.activate(torch.tensor([0, 1, 2]))
    assert st.ints[:, ds.ACTIVE].tolist() == [1, 1, 1]
    st.release(torch.tensor([2]))
    assert st.ints[:, ds.ACTIVE].tolist() == [1, 1, 0]
    assert st.ints[2, ds.TOKEN :].tolist() == [0, 4, 1, 0, 0, 2, 3, 9, 2, 1, 3, 42, 1]  # the rest stays
    st.release(torch.tensor([0, 1]))
    assert st.ints[:, ds.ACTIVE].tolist() == [0, 0, 0]


def test_kv_slots_at_and_trace_depth():
    st = _state()
    _admit(st, [row(slot=1, tables=[[1, 2], [3, 4], [5, 6], [7, 8]], params=SamplingParams(exit_trace=[2, 3, 1]))])
    slots = st.kv_slots_at(torch.tensor([1, 1]), torch.tensor([0, 6]))
    # pos 0: block 0 of each plane, offset 0; pos 6: block 1, offset 2.
    assert slots.tolist() == [[4, 12, 20, 28], [10, 18, 26, 34]]
    rows = torch.tensor([1])
    depths = []
    for ngen in range(1, 6):  # the trace is cycled over decode steps
        st.ints[1, ds.NGEN] = ngen
        depths.append(st.trace_depth(st.ints[rows], rows).item())
    assert depths == [2, 3, 1, 2, 3]


# --------------------------------------------------------------------------------------- transitions


def _decoding(params: SamplingParams, slot=0, max_loops=4, threshold=1.0, ngen=0, token=5) -> DecodeState:
    """A state whose row `slot` decodes: admitted at prompt length 5, then switched on."""
    st = _state()
    _admit(
        st,
        [
            NewRow(
                slot,
                5,
                params,
                max_loops,
                threshold,
                3,
                [[1, 2], [3, 4], [5, 6], [7, 8]],
                (token, ngen) if ngen else None,
            )
        ],
    )
    st.activate(torch.tensor([slot]))
    return st


def _advance(st, tok, lam=None, mode=ExitMode.FIXED, rows=(0,)):
    idx = torch.tensor(list(rows))
    rec = st.new_record(1)[0]
    kv_slots = st.kv_slots_at(idx, st.ints[idx, ds.POS])
    src, dst = st.advance(
        idx, lam, torch.tensor([tok] * len(rows)), torch.tensor([-0.5] * len(rows)), kv_slots, rec, mode
    )
    return rec, src, dst


def test_advance_runs_loops_then_emits_and_fills_the_deeper_planes():
    st = _decoding(SamplingParams(max_tokens=4), max_loops=2)
    rec, src, dst = _advance(st, 9)  # loop 1 of 2: no token
    assert rec[:, 0].tolist() == [ds.EMIT_NONE, 9, 1, -0.5]
    assert st.ints[0, [ds.ACTIVE, ds.TOKEN, ds.POS, ds.LOOP, ds.NGEN]].tolist() == [1, 0, 4, 2, 0]
    assert (src == -1).all() and (dst == -1).all()
    rec, src, dst = _advance(st, 9)  # loop 2: token 9 exits at depth 2
    assert rec[:, 0].tolist() == [ds.EMIT_TOKEN, 9, 2, -0.5]
    assert st.ints[0, [ds.ACTIVE, ds.TOKEN, ds.POS, ds.LOOP, ds.NGEN]].tolist() == [1, 9, 5, 1, 1]
    # Position 4 lives in block 1 of each plane at offset 0: plane 1's slot (block 4) fills planes 2-3.
    assert src.tolist() == [[-1, -1, 16, 16]] and dst.tolist() == [[-1, -1, 24, 32]]


def test_advance_records_which_stop_rule_ended_the_row():
    st = _decoding(SamplingParams(max_tokens=2), max_loops=1)
    rec, _, _ = _advance(st, 9)
    assert rec[0, 0] == ds.EMIT_TOKEN and st.ints[0, ds.ACTIVE] == 1
    rec, _, _ = _advance(st, 9)  # the second token reaches max_tokens
    assert rec[0, 0] == ds.EMIT_LENGTH and st.ints[0, ds.ACTIVE] == 0 and st.ints[0, ds.NGEN] == 2
    st = _decoding(SamplingParams(max_tokens=1), max_loops=1)
    rec, _, _ = _advance(st, EOS)  # EOS on the last allowed token: EOS wins
    assert rec[0, 0] == ds.EMIT_EOS and st.ints[0, ds.ACTIVE] == 0
    # ignore_eos, or EOS before min_tokens, does not stop.
    for params in (SamplingParams(max_tokens=4, ignore_eos=True), SamplingParams(max_tokens=4, min_tokens=2)):
        st = _decoding(params, max_loops=1)
        rec, _, _ = _advance(st, EOS)
        assert rec[0, 0] == ds.EMIT_TOKEN and st.ints[0, ds.ACTIVE] == 1


def test_an_idle_row_keeps_its_state():
    st = _decoding(SamplingParams(max_tokens=4), slot=1, max_loops=1)
    st.remaining[2] = 0.5
    before = st.ints[2].clone()
    rec, src, _ = _advance(st, 9, rows=(1, 2))
    assert rec[0].tolist() == [0, ds.EMIT_TOKEN, 0] and torch.equal(st.ints[2], before)
    assert st.remaining[2] == 0.5 and (src[1] == -1).all()


def test_the_gate_exits_when_the_hazard_crosses_the_threshold():
    st = _decoding(SamplingParams(max_tokens=4), threshold=0.5)
    rec, _, _ = _advance(st, 9, lam=torch.tensor([0.3]), mode=ExitMode.OURO)  # cdf 0.3: continue
    assert rec[0, 0] == ds.EMIT_NONE and st.remaining[0].item() == pytest.approx(0.7)
    rec, _, _ = _advance(st, 9, lam=torch.tensor([0.3]), mode=ExitMode.OURO)  # cdf 0.51: exit at loop 2
    assert rec[:3, 0].tolist() == [ds.EMIT_TOKEN, 9, 2] and st.remaining[0] == 1.0


def test_emit_first_samples_at_full_depth_and_starts_decoding():
    st = _state()
    _admit(st, [row(slot=2, params=SamplingParams(max_tokens=3))])
    rec = st.new_record(1)[0]
    st.emit_first(torch.tensor([2]), torch.tensor([11]), torch.tensor([-1.25]), rec)
    assert rec[:, 2].tolist() == [ds.EMIT_TOKEN, 11, T, -1.25]
    assert st.ints[2, [ds.ACTIVE, ds.TOKEN, ds.POS, ds.LOOP, ds.NGEN]].tolist() == [1, 11, 5, 1, 1]


def test_extend_tables_save_restore_and_restart():
    st = _decoding(SamplingParams(max_tokens=4), slot=1)
    st.extend_tables(
        torch.tensor([1, 1]), torch.tensor([0, 3]), torch.tensor([2, 2]), torch.tensor([20, 21], dtype=torch.int32)
    )
    assert st.tables[1].tolist() == [[1, 2, 20], [3, 4, 0], [5, 6, 0], [7, 8, 21]]
    st.hidden[1] = torch.tensor([0.5, -2.0])
    saved = st.save_row(1)
    st.release(torch.tensor([1]))
    st.restore_row(0, saved, torch.arange(T * MAX_BLOCKS, dtype=torch.int32).view(T, MAX_BLOCKS))
    assert st.ints[0].tolist() == saved.ints.tolist() and st.ints[0, ds.ACTIVE] == 1
    assert st.hidden[0].tolist() == [0.5, -2.0] and st.tables[0, 3].tolist() == [9, 10, 11]
    st.ints[0, ds.LOOP] = 3
    st.restart_at_loop_one(torch.tensor([0]))
    assert st.ints[0, ds.LOOP] == 1


def test_sampling_rows():
    st = _state()
    _admit(st, [row(slot=1)])
    temperature, top_k, top_p, seed, counter = st.sampling_rows(torch.tensor([1]), offset=2)
    assert (temperature.item(), top_k.item(), top_p.item(), seed.item(), counter.item()) == (0.5, 3, 0.9, 42, 2)
