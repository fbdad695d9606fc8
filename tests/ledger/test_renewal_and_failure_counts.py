"""What the fold keeps of lease renewals and failures beyond the decision itself: every renewal counted (on
the fold and on its side, whose expiry names how many it had), a renewal that moves no deadline changes
nothing (before the map too, and never a consumer's), sides due at one deadline come in map order however
they got there, every refused read counted, and a retry window that counts from the first transient
failure (what the connector's retries read)."""

from __future__ import annotations

from kvledger.ledger.events import TransferId
from kvledger.ledger.fold import REASON_LEASE_MISSED, LedgerState
from tests.ledger.builders import Side

P, C = "prefill-0/tp0", "decode-0/tp0"


def test_every_renewal_is_counted_and_the_expiry_names_how_many_there_were() -> None:
    p = Side(P, start_ts=0.0)
    state = LedgerState()
    state.apply(p.map("tx-1", "r-1", deadline=10.0))
    state.apply(p.lease("tx-1", 20.0))
    state.apply(p.lease("tx-1", 30.0))
    assert state.lease_counts["renewals"] == 2
    assert state.live[(P, TransferId("tx-1"))].leases == 2
    release = state.apply(p.expire("tx-1", ts=30.0))
    assert release is not None and release.why == "lease_missed" and release.ts == 30.0
    assert release.reason == f"{REASON_LEASE_MISSED} (2 renewals)"
    assert state.lease_counts["expiries"] == 1
    state.apply(p.map("tx-2", "r-2", blocks=(9,), deadline=40.0))
    state.apply(p.lease("tx-2", 50.0))
    state.apply(p.expire("tx-2", ts=50.0))
    assert state.lease_counts["expiries"] == 2  # every side expired after a renewal moved its deadline


def test_a_renewal_to_the_deadline_the_side_already_has_moves_nothing() -> None:
    p = Side(P, start_ts=0.0)
    state = LedgerState()
    state.apply(p.map("tx-1", "r-1", deadline=10.0))
    state.apply(p.lease("tx-1", 10.0))
    side = state.live[(P, TransferId("tx-1"))]
    assert side.lease_until is None and side.deadline == 10.0
    release = state.apply(p.expire("tx-1", ts=10.0))
    assert release is not None and release.why == "deadline"  # its map's deadline passed, not a missed lease
    assert "expiries" not in state.lease_counts


def test_sides_due_at_one_deadline_come_in_map_order_whether_a_renewal_moved_it_there_or_not() -> None:
    p = Side(P, start_ts=0.0)
    state = LedgerState()
    state.apply(p.map("tx-a", "r-a", blocks=(1,), deadline=10.0))
    state.apply(p.map("tx-b", "r-b", blocks=(2,), deadline=20.0))
    state.apply(p.lease("tx-a", 20.0))
    assert state.due(15.0) == []
    assert [t.transfer_id for t in state.due(25.0)] == ["tx-a", "tx-b"]


def test_every_refused_read_is_counted() -> None:
    c = Side(C, start_ts=0.0)
    state = LedgerState()
    for tid in ("tx-1", "tx-2"):
        state.apply(c.map(tid, f"r-{tid}", "consumer", blocks=(int(tid[-1]),), remote=(9,)))
        release = state.apply(c.fail(tid, "read_refused: released", code="read_refused"))
        assert release is not None and release.cause == "failed"
    assert state.lease_counts["reads_refused"] == 2


def test_a_retry_window_counts_from_the_first_transient_failure() -> None:
    c = Side(C, start_ts=0.0)
    state = LedgerState()
    state.apply(c.map("tx-1", "r-1", "consumer", remote=(7, 8, 9), ts=1.0))
    state.apply(c.schedule("tx-1", ts=2.0))
    state.apply(c.fail("tx-1", "SQ full", retryable=True, ts=3.0))
    state.apply(c.schedule("tx-1", attempt=1, ts=4.0))
    state.apply(c.fail("tx-1", "SQ full", retryable=True, ts=5.0))
    side = state.live[(C, TransferId("tx-1"))]
    assert side.transient_failures == 2
    assert side.transient_since == 3.0  # the first failure's time: a later one does not restart the window
    assert state.retrying == {(C, TransferId("tx-1")): side}


def test_a_renewal_before_the_map_counts_only_where_it_moves_a_producers_deadline_later() -> None:
    for role, until, deadline, why in (
        ("producer", 20.0, 20.0, "lease_missed"),  # later than the map's: the side holds until the lease
        ("producer", 5.0, 10.0, "deadline"),  # earlier: the map's deadline stands
        ("producer", 10.0, 10.0, "deadline"),  # the same: nothing moved
        ("consumer", 20.0, 10.0, "deadline"),  # a consumer holds nothing for a peer: never moved
    ):
        side = Side(P if role == "producer" else C, start_ts=0.0)
        state = LedgerState()
        state.apply(side.lease("tx-1", until))
        state.apply(side.map("tx-1", "r-1", role, remote=(1, 2, 3) if role == "consumer" else None, deadline=10.0))
        held = state.live[(side.source, TransferId("tx-1"))]
        assert held.deadline == deadline, role
        assert [t.transfer_id for t in state.due(deadline)] == ["tx-1"]
        release = state.apply(side.expire("tx-1", ts=deadline))
        assert release is not None and release.why == why, (role, until)
