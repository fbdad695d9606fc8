"""The one definition of a valid event: each rule names its field; the JSONL reader's chunk check
never accepts what the definition rejects; whatever is valid can be stored and printed."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvledger.ledger.events import Event, from_msgpack, to_msgpack
from kvledger.ledger.limits import INT64_MAX, INT64_MIN, SOURCE_CHARS_MAX, TRANSFER_ID_CHARS_MAX, TS_MAX
from kvledger.ledger.store.rows import encode_row
from kvledger.ledger.synth import SynthConfig, generate
from kvledger.ledger.valid import (
    InvalidEvent,
    _each_fits,
    check_event,
    event_problem,
    events_fit,
    json_chunk_valid,
)
from tests.fuzz.strategies import events
from tests.ledger.builders import Side

_encoder = msgspec.json.Encoder()
_decoder: msgspec.json.Decoder[Event] = msgspec.json.Decoder(Event)


def _map(**changes: Any) -> Event:
    return msgspec.structs.replace(Side("p/tp0").map("tx", "r", blocks=(1, 2), remote=(3, 4)), **changes)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"seq": 0}, "seq"),
        ({"seq": INT64_MAX + 1}, "seq"),
        ({"ts": -0.5}, "ts"),
        ({"ts": TS_MAX * 2}, "ts"),
        ({"ts": float("nan")}, "ts"),
        ({"source": ""}, "source"),
        ({"source": "s" * (SOURCE_CHARS_MAX + 1)}, "source"),
        ({"source": "p\x00"}, "source"),
        ({"transfer_id": "t" * (TRANSFER_ID_CHARS_MAX + 1)}, "transfer_id"),
        ({"request_id": ""}, "request_id"),
        ({"block_ids": (1, INT64_MIN - 1)}, "block_ids"),
        ({"remote_block_ids": (1 << 64,)}, "remote_block_ids"),
        ({"deadline": float("inf")}, "deadline"),
        ({"acks_expected": 1 << 64}, "acks_expected"),
    ],
)
def test_each_rule_names_its_field(changes: dict[str, Any], field: str) -> None:
    event = _map(**changes)
    with pytest.raises(InvalidEvent) as caught:
        check_event(event)
    assert caught.value.field == field and field in str(caught.value)


def test_the_edges_are_valid_and_unassigned_seqs_only_when_asked() -> None:
    check_event(_map(ts=0.0, deadline=TS_MAX, block_ids=(INT64_MIN, INT64_MAX), source="s" * SOURCE_CHARS_MAX))
    check_event(_map(request_id="C:\\u0000"))  # a backslash and five letters, no NUL
    assert event_problem(_map(seq=0), assigned=False) is None
    p = Side("p")
    for event in (p.ack("t", "write", (1 << 64,)), p.schedule("t", attempt=-(1 << 64)), p.seal("t", 1 << 64)):
        assert event_problem(event) is not None, event


def test_the_chunk_check_accepts_an_ordinary_log_and_looks_closer_at_odd_bytes() -> None:
    batch = list(generate(SynthConfig(transfers=200, fault_rate=0.3), seed=2))
    raw = _encoder.encode_lines(batch)
    assert json_chunk_valid(_decoder.decode_lines(raw), raw)
    odd = [_map(request_id="C:\\u0000")]  # valid, but its bytes hold the NUL escape: each is checked
    raw = _encoder.encode_lines(odd)
    assert not json_chunk_valid(_decoder.decode_lines(raw), raw) and event_problem(odd[0]) is None


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(events, min_size=1, max_size=8))
def test_the_chunk_check_never_accepts_what_the_definition_rejects(batch: list[Event]) -> None:
    raw = _encoder.encode_lines(batch)
    try:
        decoded = _decoder.decode_lines(raw)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
        return  # NaN and infinity encode as null: such a line never decodes to reach the check
    if json_chunk_valid(decoded, raw):
        assert [event_problem(e) for e in decoded] == [None] * len(decoded)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(events, min_size=1, max_size=8))
def test_the_chunk_checks_event_loop_is_the_definition_but_for_nul(batch: list[Event]) -> None:
    """The loop the compiled build runs (and the interpreted one can): exactly `event_problem`, but for
    NUL characters, which the chunk check looks for in the bytes before."""
    raw = _encoder.encode_lines(batch)
    try:
        decoded = _decoder.decode_lines(raw)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
        return
    decoded = [e for e in decoded if b"\\u0000" not in _encoder.encode(e)]
    assert _each_fits(decoded) == all(event_problem(e) is None for e in decoded)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(events, min_size=1, max_size=8))
def test_the_batch_check_of_events_is_exactly_the_definition(batch: list[Event]) -> None:
    """A store's append checks a writer's batch at once (`events_fit`), NUL characters included."""
    assert events_fit(batch) == all(event_problem(e) is None for e in batch)


@settings(max_examples=300, deadline=None)
@given(events)
def test_what_is_valid_can_be_stored(event: Event) -> None:
    if event_problem(event) is None:
        row = encode_row(event)
        assert from_msgpack(row[5]) == event == from_msgpack(to_msgpack(event))
