"""`drop` (a refused, unproven control message): counted and audited, and it changes nothing about any side."""

from __future__ import annotations

from kvledger.ledger.audit import audit
from kvledger.ledger.fold import fold_all
from kvledger.ledger.ledger import Ledger
from kvledger.ledger.store.snapshot import decode, encode
from tests.ledger.builders import Side

P = "prefill-0/tp0"


def test_a_drop_changes_no_decision_and_makes_no_side() -> None:
    p = Side(P, start_ts=0.0)
    with_drops = [
        p.map("t", "p-1", ts=0.0),
        p.drop("t", ts=1.0),
        p.drop("never-mapped", ts=1.5),
        p.ack("t", "release", ts=2.0),
    ]
    q = Side(P, start_ts=0.0)
    without = [q.map("t", "p-1", ts=0.0), q.ack("t", "release", ts=2.0)]
    state, releases = fold_all(with_drops)
    plain_state, plain_releases = fold_all(without)
    assert [(r.transfer_id, r.cause, r.ts) for r in releases] == [
        (r.transfer_id, r.cause, r.ts) for r in plain_releases
    ]
    assert set(state.transfers) == set(plain_state.transfers) == {(P, "t")}  # no side for "never-mapped"
    assert state.forged_by_reason == {"bad_mac": 2}


def test_each_drop_is_a_forged_message_finding_with_its_event() -> None:
    p = Side(P, start_ts=0.0)
    events = [p.map("t", "p-1", ts=0.0, deadline=100.0), p.drop("t", "release", ts=1.0)]
    state, _ = fold_all(events)
    (finding,) = audit(state, 2.0)
    assert (finding.code, finding.severity, finding.transfer_id, finding.evidence) == (
        "forged_message", "error", "t", (2,),
    )  # fmt: skip
    assert "release from 127.0.0.1 dropped (bad_mac)" in finding.detail


def test_a_snapshot_keeps_the_counts_of_drops() -> None:
    p = Side(P, start_ts=0.0)
    ledger = Ledger(P)
    ledger.extend([p.map("t", "p-1", ts=0.0), p.drop("t", reason="sender_not_allowed", ts=1.0)])
    restored = decode(encode(ledger.state))
    assert restored.forged_by_reason == {"sender_not_allowed": 1}
