"""Lease renewals (`ack` what=lease): they move a producer side's deadline later, never earlier, and a side
whose consumer stops renewing expires at its last lease."""

from __future__ import annotations

import msgspec
import pytest

from kvledger.ledger.events import Ack, Expire, Fail, Map, ReqId, TransferId
from kvledger.ledger.fold import LedgerState
from kvledger.ledger.side import due_at
from tests.ledger.histories import Shape, history

P = "prefill-0/tp0"
T = TransferId("tx-1")


def _map(deadline: float = 10.0, role: str = "producer", seq: int = 1) -> Map:
    return Map(
        seq=seq, ts=0.0, source=P, transfer_id=T, request_id=ReqId("r"), role=role,  # type: ignore[arg-type]
        mode="read", block_ids=(1, 2), deadline=deadline,
    )  # fmt: skip


def _lease(until: float, seq: int, ts: float = 1.0) -> Ack:
    return Ack(seq=seq, ts=ts, source=P, transfer_id=T, what="lease", until=until)


def test_a_renewal_moves_the_deadline_later_and_due_follows_it() -> None:
    state = LedgerState()
    state.apply(_map(deadline=10.0))
    state.apply(_lease(25.0, seq=2))
    side = state.live[(P, T)]
    assert side.deadline == 25.0
    assert state.due(12.0) == []  # the map's deadline passed, the lease's did not
    assert [t.transfer_id for t in state.due(25.0)] == [T]
    assert state.lease_counts["renewals"] == 1


def test_a_renewal_never_moves_the_deadline_earlier() -> None:
    state = LedgerState()
    state.apply(_map(deadline=10.0))
    state.apply(_lease(25.0, seq=2))
    state.apply(_lease(15.0, seq=3))
    assert state.live[(P, T)].deadline == 25.0
    assert state.due(20.0) == []


def test_a_consumer_that_stops_renewing_is_expired_at_its_last_lease() -> None:
    state = LedgerState()
    state.apply(_map(deadline=10.0))
    state.apply(_lease(20.0, seq=2))
    release = state.apply(Expire(seq=3, ts=20.0, source=P, transfer_id=T, deadline="defer"))
    assert release is not None and release.cause == "expired"
    assert release.why == "lease_missed"
    assert state.lease_counts["expiries"] == 1


def test_a_lease_after_the_decision_is_late_evidence() -> None:
    state = LedgerState()
    state.apply(_map(deadline=10.0))
    state.apply(Expire(seq=2, ts=10.0, source=P, transfer_id=T, deadline="defer"))
    state.apply(_lease(30.0, seq=3, ts=11.0))
    side = state.side((P, T))
    assert side is not None and side.late_seqs == [3]


def test_a_lease_before_the_map_counts_when_it_is_later() -> None:
    state = LedgerState()
    state.apply(_lease(30.0, seq=1))
    state.apply(_map(deadline=10.0, seq=2))
    assert state.live[(P, T)].deadline == 30.0
    assert state.due(20.0) == []


def test_a_lease_on_a_consumer_side_is_over_ack_evidence_and_moves_nothing() -> None:
    state = LedgerState()
    state.apply(_map(deadline=10.0, role="consumer"))
    state.apply(_lease(30.0, seq=2))
    side = state.live[(P, T)]
    assert side.deadline == 10.0 and side.over_ack_seqs == [2]


def test_refused_reads_are_counted() -> None:
    state = LedgerState()
    state.apply(_map(deadline=10.0, role="consumer"))
    release = state.apply(
        Fail(seq=2, ts=1.0, source=P, transfer_id=T, reason="read_refused: released", code="read_refused")
    )
    assert release is not None and release.load_error
    assert state.lease_counts["reads_refused"] == 1


def test_a_lease_ack_needs_until_and_only_a_lease_has_one() -> None:
    with pytest.raises(ValueError):
        Ack(ts=0.0, source=P, transfer_id=T, what="lease")
    with pytest.raises(ValueError):
        Ack(ts=0.0, source=P, transfer_id=T, what="release", until=3.0)
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"kind":"ack","ts":0,"source":"p","transfer_id":"t","what":"lease"}', type=Ack)


def test_the_heap_sweep_keeps_only_current_deadlines() -> None:
    state = LedgerState()
    state.apply(_map(deadline=10.0))
    for i in range(200):
        state.apply(_lease(11.0 + i, seq=2 + i))
    assert len(state.deadlines) < 200  # swept as renewals pile up
    assert [d[0] for d in state.deadlines if d[3] == T][-1] <= 210.0
    assert state.due(209.0) == [] and len(state.due(210.0)) == 1


def test_due_at_is_the_deadline_of_a_live_side_and_none_otherwise() -> None:
    """`due_at`, the deadline heap's C-field reading of a side, agrees with the properties (`live`,
    `deadline`) on every side of generated histories, at every step of their folds."""
    for seed in range(4):
        state = LedgerState()
        for event in history(seed, Shape(transfers=40, faults_per_side=0.5)):
            state.apply(event)
            for t in state.transfers.values():
                assert due_at(t) == (t.deadline if t.live else None)
