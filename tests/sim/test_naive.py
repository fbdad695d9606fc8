"""The naive baseline's four rules, each against the fold on the same hand-written observations."""

from __future__ import annotations

from kvledger.connector.sim.naive import NaiveBookkeeping, run_naive
from kvledger.ledger.events import Ack, Event, Expire, Fail, Map, ReqId, Schedule, Seal, TransferId
from kvledger.ledger.fold import fold_all

SOURCE = "prefill-0/tp0"
TID = TransferId("tx-1")


def _map(seq: int, mode: str = "read", role: str = "producer") -> Map:
    return Map(
        seq=seq, ts=float(seq), source=SOURCE, transfer_id=TID, request_id=ReqId("p-1"), role=role,  # type: ignore[arg-type]
        mode=mode, block_ids=(1, 2), deadline=10.0,  # type: ignore[arg-type]
    )  # fmt: skip


def _both(events: list[Event]) -> tuple[bool, bool]:
    """(the fold released, naive released)."""
    _, releases = fold_all(events)
    book = NaiveBookkeeping(SOURCE)
    for e in events:
        book.observe(e)
    return bool(releases), bool(book.released)


def test_happy_path_agrees() -> None:
    read: list[Event] = [_map(1), Ack(seq=2, ts=2.0, source=SOURCE, transfer_id=TID, what="release")]
    assert _both(read) == (True, True)
    write: list[Event] = [
        _map(1, "write"),
        Schedule(seq=2, ts=2.0, source=SOURCE, transfer_id=TID, op="write", layers=(0, 1)),
        Seal(seq=3, ts=3.0, source=SOURCE, transfer_id=TID, expected=2),
        Ack(seq=4, ts=4.0, source=SOURCE, transfer_id=TID, what="write", layers=(0, 1)),
    ]
    assert _both(write) == (True, True)


def test_no_deadline_expire_is_ignored() -> None:
    assert _both([_map(1), Expire(seq=2, ts=11.0, source=SOURCE, transfer_id=TID, deadline="defer")]) == (True, False)


def test_an_ack_before_its_map_is_dropped() -> None:
    events: list[Event] = [Ack(seq=1, ts=1.0, source=SOURCE, transfer_id=TID, what="release"), _map(2)]
    assert _both(events) == (True, False)
    outcome = run_naive({SOURCE: events})
    assert (outcome.dropped_acks, outcome.hung_requests, outcome.leaked_blocks) == (1, 1, 2)


def test_send_queue_full_is_terminal_and_failures_never_release() -> None:
    transient: list[Event] = [
        _map(1, "read", "consumer"),
        Fail(seq=2, ts=2.0, source=SOURCE, transfer_id=TID, reason="SQ full", retryable=True),
        Ack(seq=3, ts=3.0, source=SOURCE, transfer_id=TID, what="read"),  # the retry landed
    ]
    assert _both(transient) == (True, False)
    terminal: list[Event] = [_map(1), Fail(seq=2, ts=2.0, source=SOURCE, transfer_id=TID, reason="link down")]
    assert _both(terminal) == (True, False)


def test_lost_sides_are_counted_for_neither() -> None:
    outcome = run_naive({SOURCE: [_map(1)]}, lost={(SOURCE, TID)})
    assert outcome.hung_requests == 0 and outcome.leaked_blocks == 0
