"""When a finding became true, in log time (`kvledger.ledger.audit.found_at`, what the board plots findings by):
a leak at its side's deadline, stuck and never-mapped sides when the transfer timeout ran out after their
last (stuck) or first (orphan) event, rule S's findings at the last event past the id window, anything else
at its side's last event, and 0 for a side retired since."""

from __future__ import annotations

from kvledger.ledger.audit import AuditConfig, Finding, audit, found_at
from kvledger.ledger.events import Ack, Event, TransferId
from kvledger.ledger.fold import fold_all
from kvledger.ledger.ids import stamped_id
from kvledger.ledger.limits import ARRIVAL_LAG_S, DEFAULT_TRANSFER_TIMEOUT_S, ID_WINDOW_S
from tests.ledger.builders import Side

T = TransferId("tx-1")
P, C = "prefill-0/tp0", "decode-0/tp0"
ISSUED = 5000.0
PAST = ISSUED + ID_WINDOW_S + ARRIVAL_LAG_S + 5.0
"""Past a stamped id's window (and its tombstone's retirement) issued at ISSUED."""


def _only(findings: list[Finding], code: str) -> Finding:
    found = [f for f in findings if f.code == code]
    assert len(found) == 1, found
    return found[0]


def test_a_leak_is_found_at_its_deadline() -> None:
    p = Side(P, start_ts=1000.0)
    state, _ = fold_all([p.map(T, "r-1", deadline=1060.0), p.schedule(T)])
    leak = _only(audit(state, 2000.0), "leak")
    assert found_at(leak, state) == 1060.0


def test_a_leak_is_found_at_the_deadline_a_lease_moved() -> None:
    p = Side(P, start_ts=1000.0)
    state, _ = fold_all([p.map(T, "r-1", deadline=1060.0)])
    state.apply(Ack(seq=2, ts=1050.0, source=P, transfer_id=TransferId(T), what="lease", until=1120.0))
    leak = _only(audit(state, 2000.0), "leak")
    assert found_at(leak, state) == 1120.0


def test_a_stuck_side_is_found_a_transfer_timeout_after_its_last_event() -> None:
    p = Side(P, start_ts=1000.0)
    events: list[Event] = [p.map(T, "r-1", deadline=9000.0), p.schedule(T, ts=1010.0)]
    state, _ = fold_all(events)
    config = AuditConfig(transfer_timeout_s=5.0)
    stuck = _only(audit(state, 2000.0, config), "stuck")
    assert found_at(stuck, state, config) == 1015.0  # not the deadline, not the map's time
    stuck = _only(audit(state, 2000.0), "stuck")
    assert found_at(stuck, state) == 1010.0 + DEFAULT_TRANSFER_TIMEOUT_S  # no config: the default timeout


def test_a_never_mapped_side_is_found_a_transfer_timeout_after_its_first_event() -> None:
    c = Side(C, start_ts=1000.0)
    state, _ = fold_all([c.ack(T, "recv", ts=1000.0), c.schedule(T, ts=1004.0)])
    config = AuditConfig(transfer_timeout_s=5.0)
    orphan = _only(audit(state, 2000.0, config), "orphan_ack")
    assert found_at(orphan, state, config) == 1005.0  # its first event's time, not its last's
    assert found_at(orphan, state) == 1000.0 + DEFAULT_TRANSFER_TIMEOUT_S


def test_other_findings_on_a_never_mapped_side_are_found_at_its_last_event() -> None:
    c = Side(C, start_ts=1000.0)
    state, _ = fold_all([c.ack(T, "recv"), c.ack(T, "recv", ts=1003.0)])
    duplicate = _only(audit(state, 1010.0), "duplicate")
    assert state.transfers[(C, T)].role is None
    assert found_at(duplicate, state) == 1003.0


def test_a_finding_of_a_decided_side_is_found_at_its_last_event() -> None:
    p = Side(P, start_ts=1000.0)
    events: list[Event] = [p.map(T, "r-1", deadline=1060.0), p.ack(T, "release"), p.ack(T, "release", ts=1007.0)]
    state, _ = fold_all(events)
    late = _only(audit(state, 2000.0), "late_event")
    assert found_at(late, state) == 1007.0  # not its deadline: decided sides leak nothing


def _stamped_decided(rand: int) -> tuple[TransferId, Side, list[Event]]:
    tid = stamped_id(ISSUED, rand)
    p = Side(P, start_ts=ISSUED + 1.0)
    events: list[Event] = [p.map(tid, "p-1", blocks=(1, 2)), p.ack(tid, "release")]
    return tid, p, events


def test_a_map_past_the_id_window_is_found_at_the_last_such_event() -> None:
    tid, p, events = _stamped_decided(1)
    events += [p.map(tid, "p-again", blocks=(3,), ts=PAST), p.map(tid, "p-again", blocks=(3,), ts=PAST + 2.0)]
    state, _ = fold_all(events)
    reuse = _only(audit(state, PAST + 10.0), "id_reuse")
    assert reuse.evidence == (3, 4)
    assert found_at(reuse, state) == PAST + 2.0


def test_a_late_event_past_the_id_window_is_found_at_the_last_such_event() -> None:
    tid, p, events = _stamped_decided(2)
    events += [p.ack(tid, "release", rank=1, ts=PAST), p.expire(tid, ts=PAST + 3.0)]
    state, _ = fold_all(events)
    late = _only(audit(state, PAST + 10.0), "late_event")
    assert found_at(late, state) == PAST + 3.0
    state.forget_decided(ISSUED + 100.0)
    state.retire(PAST - 1.0)
    assert state.side((P, tid)) is None  # the side retired: the rule S record alone tells the time
    assert found_at(late, state) == PAST + 3.0


def test_a_sides_own_finding_is_found_at_its_last_event_beside_a_rule_s_record() -> None:
    tid, p, events = _stamped_decided(3)
    events += [p.ack(tid, "release", ts=ISSUED + 10.0), p.ack(tid, "release", rank=1, ts=PAST)]
    state, _ = fold_all(events)
    assert (P, tid) in state.past_window
    late = {f.evidence: f for f in audit(state, PAST + 10.0) if f.code == "late_event"}
    assert set(late) == {(3,), (4,)}  # one inside the window, on the side; one past it, judged alone
    assert found_at(late[(3,)], state) == ISSUED + 10.0  # the side's last event, not the record's
    assert found_at(late[(4,)], state) == PAST


def test_a_finding_of_a_side_retired_since_has_no_time() -> None:
    tid, p, events = _stamped_decided(4)
    events.append(p.ack(tid, "release", ts=ISSUED + 10.0))
    state, _ = fold_all(events)
    late = _only(audit(state, ISSUED + 20.0), "late_event")
    assert found_at(late, state) == ISSUED + 10.0
    state.forget_decided(ISSUED + 100.0)
    state.retire(PAST)
    assert state.side((P, tid)) is None
    assert found_at(late, state) == 0.0
