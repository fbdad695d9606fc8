"""The audit's boundaries, each exactly on and one tick either side, and its severity table.

Times are multiples of 1/64 s, so `x + timeout == now` holds exactly and no rounding decides a case.
The rules: a deadline is due at its instant (a leak from then on; the running ledger expires it then);
a side is stuck only after more than the transfer timeout without an event; never-mapped events become
an orphan finding at exactly the transfer timeout (as their expiry does); a premature release needs the
consumer's read to finish more than the clock skew after the producer's expiry.
"""

from __future__ import annotations

import pytest

from kvledger.ledger.audit import CODES, AuditConfig, Finding, audit, counts_by_code
from kvledger.ledger.events import Drop, TransferId
from kvledger.ledger.fold import LedgerState, fold_all
from kvledger.ledger.humanize import duration
from kvledger.ledger.ledger import Ledger
from kvledger.ledger.summary import worst_severity
from tests.ledger.builders import Side

TICK = 1 / 64
P, C = "prefill-0/tp0", "decode-0/tp0"


def _codes(findings: list[Finding]) -> list[str]:
    return sorted(f.code for f in findings)


def test_a_leak_is_reported_from_the_deadline_on_and_the_deadline_is_due_at_its_instant() -> None:
    p = Side(P, start_ts=0.0)
    state, _ = fold_all([p.map("a", "p-a", deadline=10.0, ts=0.0)])
    assert audit(state, 10.0 - TICK) == [] and state.due(10.0 - TICK) == []
    (leak,) = audit(state, 10.0)
    assert (leak.code, leak.evidence) == ("leak", (1,))
    assert leak.detail == "3 blocks held 0 s past the deadline, no decision"
    assert [t.transfer_id for t in state.due(10.0)] == ["a"]


def test_stuck_needs_more_than_the_transfer_timeout_without_an_event() -> None:
    p = Side(P, start_ts=0.0)
    state, _ = fold_all([p.map("a", "p-a", deadline=100.0, ts=0.0), p.schedule("a", ts=2.0)])
    assert audit(state, 32.0) == []
    (stuck,) = audit(state, 32.0 + TICK)
    assert (stuck.code, stuck.severity, stuck.evidence) == ("stuck", "warning", (1, 2))
    assert stuck.detail == "no event for 30 s (over the transfer timeout, 30 s) in phase active"
    config = AuditConfig(transfer_timeout_s=10.0)
    assert audit(state, 12.0, config) == [] and _codes(audit(state, 12.0 + TICK, config)) == ["stuck"]


def test_due_sides_come_earliest_deadline_first_and_the_running_ledger_expires_them_so() -> None:
    p = Side(P, start_ts=0.0)
    events = [
        p.map("late", "p-1", blocks=(1,), deadline=20.0, ts=0.0),
        p.map("early", "p-2", blocks=(2,), deadline=10.0, ts=0.0),
        p.map("same", "p-3", blocks=(3,), deadline=10.0, ts=0.0),
    ]
    state, _ = fold_all(events)
    assert [t.transfer_id for t in state.due(30.0)] == ["early", "same", "late"]
    ledger = Ledger(P, clock=lambda: 0.0)
    ledger.extend(events)
    assert [r.transfer_id for r in ledger.expire_due(30.0, transfer_timeout_s=30.0)] == ["early", "same", "late"]


def test_a_leak_is_not_also_stuck() -> None:
    p = Side(P, start_ts=0.0)
    state, _ = fold_all([p.map("a", "p-a", deadline=40.0, ts=0.0)])
    assert _codes(audit(state, 39.0)) == ["stuck"]
    assert _codes(audit(state, 40.0)) == ["leak"]


def test_never_mapped_events_are_an_orphan_at_exactly_the_transfer_timeout_and_expire_then() -> None:
    p = Side(P, start_ts=0.0)
    events = [p.ack("o", "release", ts=1.0), p.ack("o", "release", rank=1, ts=5.0)]
    state, _ = fold_all(events)
    assert audit(state, 31.0 - TICK) == []
    (orphan,) = audit(state, 31.0)
    assert (orphan.code, orphan.severity, orphan.evidence, orphan.request_id) == ("orphan_ack", "warning", (1, 2), None)
    assert orphan.detail == "2 events for a transfer never mapped: unmapped for 30 s"
    ledger = Ledger(P, clock=lambda: 0.0)
    ledger.extend(events)
    ledger.expire_due(31.0 - TICK, transfer_timeout_s=30.0)
    assert ledger.state.unmapped
    ledger.expire_due(31.0, transfer_timeout_s=30.0)
    assert not ledger.state.unmapped and list(ledger.state.orphans_expired) == [(P, "o")]


def test_the_running_ledger_expires_a_deadline_at_its_instant() -> None:
    p = Side(P, start_ts=0.0)
    ledger = Ledger(P, clock=lambda: 0.0)
    ledger.append(p.map("a", "p-a", deadline=10.0, ts=0.0))
    assert ledger.expire_due(10.0 - TICK, transfer_timeout_s=30.0) == []
    (release,) = ledger.expire_due(10.0, transfer_timeout_s=30.0)
    assert (release.cause, release.ts, release.reason) == ("expired", 10.0, "defer deadline passed")


def _premature_at(gap: float, skew: float) -> list[Finding]:
    p, c = Side(P, start_ts=0.0), Side(C, start_ts=0.0)
    events = [
        p.map("t", "p-t", deadline=5.0, ts=0.0),
        c.map("t", "c-t", "consumer", "read", remote=(1, 2, 3), ts=0.5),
        c.schedule("t", ts=1.0),
        p.expire("t", ts=5.0),
        c.ack("t", "read", ts=5.0 + gap),
    ]
    state, releases = fold_all(events)
    assert [(r.role, r.cause) for r in releases] == [("producer", "expired"), ("consumer", "completed")]
    return [f for f in audit(state, 100.0, AuditConfig(clock_skew_s=skew)) if f.code == "premature_release"]


def test_a_premature_release_is_found_when_the_consumers_log_starts_before_its_map() -> None:
    p, c = Side(P, start_ts=0.0), Side(C, start_ts=0.0)
    events = [
        p.map("t", "p-t", deadline=5.0, ts=0.0),
        p.expire("t", ts=5.0),
        c.ack("t", "read", ts=7.0),  # the consumer's first event anywhere: before its map
        c.map("t", "c-t", "consumer", "read", remote=(1, 2, 3), ts=7.0),
    ]
    state, releases = fold_all(events)
    assert [(r.role, r.cause) for r in releases] == [("producer", "expired"), ("consumer", "completed")]
    assert [(f.code, f.evidence) for f in audit(state, 8.0)] == [("premature_release", (2, 1))]


def test_a_write_mode_consumer_has_its_kv_at_recv_not_at_a_write_ack() -> None:
    p, c = Side(P, start_ts=0.0), Side(C, start_ts=0.0)
    events = [
        p.map("t", "p-t", "producer", "write", deadline=5.0, ts=0.0),
        c.map("t", "c-t", "consumer", "write", remote=(1, 2, 3), ts=0.0),
        p.expire("t", ts=5.0),
        c.ack("t", "write", ts=5.25),  # the whole transfer written: within the skew
        c.ack("t", "recv", ts=7.0),  # arrived: beyond it
    ]
    state, _ = fold_all(events)
    assert [(f.code, f.evidence) for f in audit(state, 8.0)] == [("premature_release", (2, 3))]


@pytest.mark.parametrize("skew", [0.0, 0.5, 2.0])
def test_a_premature_release_needs_a_gap_beyond_the_clock_skew(skew: float) -> None:
    assert _premature_at(skew, skew) == []
    assert _premature_at(skew - TICK, skew) == []
    (found,) = _premature_at(skew + TICK, skew)
    assert (found.severity, found.source, found.request_id, found.evidence) == ("error", P, "p-t", (2, 3))
    assert found.detail == (
        f"released by expire at 1970-01-01 00:00:05.000000 UTC; consumer {C} finished reading "
        f"{duration(skew + TICK)} later (seq 3 there)"
    )


def test_the_severity_table() -> None:
    assert CODES == {
        "leak": "error",
        "double_owner": "error",
        "premature_release": "error",
        "id_reuse": "error",
        "forged_message": "error",
        "stuck": "warning",
        "orphan_ack": "warning",
        "late_event": "warning",
        "over_ack": "warning",
        "duplicate": "info",
    }


def test_every_finding_carries_its_codes_severity_and_the_worst_comes_first() -> None:
    p, c = Side(P, start_ts=0.0), Side(C, start_ts=0.0)
    events = [
        p.map("leak", "p-1", blocks=(1,), deadline=10.0, ts=0.0),
        p.map("stuck", "p-2", blocks=(2,), deadline=500.0, ts=0.0),
        p.map("owner", "p-3", blocks=(2, 3), deadline=500.0, ts=0.0),  # block 2 is held by "stuck"
        p.ack("orphan", "release", ts=0.0),
        p.map("done", "p-4", blocks=(4,), ts=0.0),
        p.ack("done", "release", ts=1.0),
        p.ack("done", "release", ts=1.0),  # late
        p.map("done", "p-other", blocks=(9,), ts=1.0),  # reused id
        p.map("done", "p-4", blocks=(4,), ts=1.0),  # the same map again: duplicate
        p.map("over", "p-5", "producer", "write", blocks=(5,), deadline=500.0, ts=0.0),
        p.ack("over", "write", (3,), ts=0.0),  # never scheduled
        p.map("pre", "p-6", blocks=(6,), deadline=2.0, ts=0.0),
        p.expire("pre", ts=2.0),
        c.map("pre", "c-6", "consumer", "read", blocks=(6,), remote=(6,), ts=0.0),
        c.ack("pre", "read", ts=3.0),
        Drop(ts=4.0, source=P, transfer_id=TransferId("pre"), message="release", sender="127.0.0.1", reason="bad_mac"),
    ]
    state, _ = fold_all(events)
    findings = audit(state, 60.0)
    assert counts_by_code(findings) == dict.fromkeys(CODES, 1) | {"stuck": 3}  # "owner" and "over" too
    assert all(f.severity == CODES[f.code] for f in findings)
    ranks = [("error", "warning", "info").index(f.severity) for f in findings]
    assert ranks == sorted(ranks) and worst_severity(findings) == "error"
    assert worst_severity([f for f in findings if f.severity != "error"]) == "warning"
    assert worst_severity([f for f in findings if f.code == "duplicate"]) == "info" and worst_severity([]) is None


def test_audit_config_rejects_what_cannot_be_a_timeout_or_a_skew() -> None:
    with pytest.raises(ValueError, match="transfer_timeout_s"):
        AuditConfig(transfer_timeout_s=0.0)
    with pytest.raises(ValueError, match="clock_skew_s"):
        AuditConfig(clock_skew_s=-TICK)
    assert AuditConfig(clock_skew_s=0.0).clock_skew_s == 0.0
    assert AuditConfig(transfer_timeout_s=TICK, clock_skew_s=TICK).transfer_timeout_s == TICK


def test_an_empty_state_has_no_findings() -> None:
    assert audit(LedgerState(), 1e9) == []
