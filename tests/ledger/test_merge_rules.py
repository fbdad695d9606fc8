"""The merge's refusals and edges (kvledger.ledger.merge): an input with no events adds nothing, a source's
seq must rise strictly within its input, one source in two inputs is two ledgers' logs merged by mistake,
and each refusal names the source, the seq and the input(s) by the caller's names."""

from __future__ import annotations

import pytest

from kvledger.ledger.events import Event
from kvledger.ledger.merge import OverlapError, merge, merge_chunks
from tests.ledger.builders import Side


def test_an_input_with_no_events_adds_nothing() -> None:
    p = Side("p")
    events: list[Event] = [p.ack("t", "recv"), p.ack("t", "recv")]
    assert [e for chunk in merge_chunks([[], [[], []], [[], events]]) for e in chunk] == events
    assert list(merge([[], events, []])) == events
    assert list(merge([])) == [] and list(merge([[]])) == []


def test_a_seq_repeated_within_one_input_is_refused_naming_the_source_and_seq() -> None:
    p = Side("p")
    first, second = p.ack("t", "recv"), p.ack("t", "recv")
    with pytest.raises(OverlapError) as refused:
        list(merge_chunks([[[first, second, second]]], ["a.jsonl"]))
    assert str(refused.value) == "source 'p' seq 2 is out of order in a.jsonl"


def test_a_seq_going_back_within_one_input_is_refused_naming_the_source_and_seq() -> None:
    p = Side("p")
    first, second = p.ack("t", "recv"), p.ack("t", "recv")
    with pytest.raises(OverlapError) as refused:
        list(merge_chunks([[[second], [first]]]))
    assert str(refused.value) == "source 'p' seq 1 is out of order in input 1"


def test_one_source_in_two_inputs_is_refused_naming_both() -> None:
    left, right = Side("p", start_ts=10.0), Side("p", start_ts=20.0)
    streams = [[left.ack("t", "recv")], [right.ack("u", "recv"), right.ack("u", "recv")]]
    with pytest.raises(OverlapError) as refused:
        list(merge(streams, ["a.jsonl", "b.jsonl"]))
    assert str(refused.value) == (
        "source 'p' seq 1 appears in both a.jsonl and b.jsonl: "
        "these logs overlap (two copies of one log, or two ledgers with the same source name)"
    )
    with pytest.raises(OverlapError, match="appears in both input 1 and input 2"):
        list(merge(streams))
