"""`find_gaps`: the seq ranges missing before a batch's events, per source, whichever way they are found
(the whole batch at once when nothing is missing, a walk over the events otherwise)."""

from __future__ import annotations

import pytest

from kvledger.api.ingest import find_gaps
from kvledger.ledger.events import Ack, Event, TransferId


def _acks(*keys: tuple[str, int]) -> list[Event]:
    return [Ack(seq=seq, ts=1.0, source=source, transfer_id=TransferId("t"), what="recv") for source, seq in keys]


@pytest.mark.parametrize(
    ("keys", "stored_max", "expected"),
    [
        ([("a", 1), ("a", 2), ("a", 3)], {}, []),
        ([("a", 4), ("a", 5)], {"a": 3}, []),
        ([("a", 2), ("a", 3), ("a", 4), ("a", 5)], {"a": 3}, []),  # a retry overlapping what is stored
        ([("a", 2), ("a", 3)], {"a": 9}, []),  # all stored already
        ([("a", 2), ("a", 3)], {}, [("a", 1, 1)]),  # contiguous, but not from the first seq
        ([("a", 6), ("a", 7)], {"a": 3}, [("a", 4, 5)]),
        ([("a", 1), ("a", 3), ("a", 4)], {}, [("a", 2, 2)]),
        ([("a", 1), ("a", 3), ("a", 5), ("a", 6)], {}, [("a", 2, 2), ("a", 4, 4)]),
        ([("a", 1), ("b", 1), ("a", 2), ("b", 2)], {}, []),
        ([("a", 1), ("b", 3), ("a", 2), ("b", 4)], {"b": 1}, [("b", 2, 2)]),
        ([("a", 5), ("b", 1), ("a", 6)], {"a": 1}, [("a", 2, 4)]),
    ],
)
def test_gaps_are_the_missing_seqs_before_each_source(
    keys: list[tuple[str, int]], stored_max: dict[str, int], expected: list[tuple[str, int, int]]
) -> None:
    found = find_gaps(_acks(*keys), stored_max)
    assert [(g.source, g.missing_from, g.missing_to) for g in found] == expected
