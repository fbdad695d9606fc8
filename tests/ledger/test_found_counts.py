"""Findings counted when first found (`found_by_code`) are what an audit of the whole log reports, however
often a running ledger forgets decided sides: forgetting never lowers them, and a side forgotten and then
recalled by another event of a kind it had is not counted twice. The audit of a forgetting ledger's state
(what is open now) loses those findings; the counts do not."""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from kvledger.ledger.audit import audit, counts_by_code
from kvledger.ledger.events import Event
from kvledger.ledger.fold import LedgerState
from kvledger.ledger.ledger import Ledger
from kvledger.ledger.limits import REPLAY_RETAIN_S
from kvledger.ledger.merge import batched
from kvledger.ledger.replay import replay_chunks
from kvledger.ledger.store import snapshot
from tests.ledger.builders import Side
from tests.ledger.histories import Shape, history

EVENT_CODES = ("late_event", "duplicate", "over_ack", "id_reuse")
"""The codes found by an event on a side; `orphan_ack` is found when a never-mapped side expires."""

LONG = Shape(
    transfers=200, span_s=10 * REPLAY_RETAIN_S, late_gap_s=3 * REPLAY_RETAIN_S, faults_per_side=1.0,
    reuse_rate=0.15, orphan_rate=0.1, overfull_rate=0.1,
)  # fmt: skip
"""Late events, duplicates and reused ids coming up to three retention windows after their side's decision,
so after a running ledger forgot it; orphans, some expired and mapped after."""

PROPERTY = settings(max_examples=15, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


def _offline(events: list[Event]) -> dict[str, int]:
    """What an offline replay of the whole log reports: the audit's counts of the codes found by events, and
    the never-mapped sides that expired (the audit's orphan_ack also names those overdue and not expired yet,
    which the connector expires at the transfer timeout: `Ledger.expire_due`)."""
    state = replay_chunks(batched(events, 64)).state
    counts = counts_by_code(audit(state, events[-1].ts))
    out = {code: counts[code] for code in EVENT_CODES if counts[code]}
    if state.orphans_expired:
        out["orphan_ack"] = len(state.orphans_expired)
    return out


@PROPERTY
@given(seed=st.integers(0, 2**32 - 1), retain_s=st.sampled_from([0.0, 1.0, 5.0]), every=st.sampled_from([1, 3, 50]))
def test_a_running_ledger_that_forgets_counts_the_findings_an_offline_replay_reports(
    seed: int, retain_s: float, every: int
) -> None:
    note(f"history({seed}, LONG)")
    events = history(seed, LONG)
    found: Counter[str] = Counter()
    still_open: Counter[str] = Counter()
    forgot = 0
    by_source: dict[str, list[Event]] = {}
    for event in events:
        by_source.setdefault(event.source, []).append(event)
    for source, own in by_source.items():
        ledger = Ledger(source)
        for n, event in enumerate(own, 1):
            ledger.append(event)
            if n % every == 0:
                forgot += ledger.state.forget_decided(event.ts - retain_s)
        assert ledger.state.tombstones_evicted == 0 and ledger.state.orphans_evicted == 0
        found.update(ledger.state.found_by_code)
        still_open.update(counts_by_code(audit(ledger.state, events[-1].ts)))
    expected = _offline(events)
    assert forgot > 0
    assert dict(found) == expected
    note(f"open in the forgetting ledgers' audit: {dict(still_open)}; offline: {expected}")


def test_a_side_forgotten_and_recalled_by_another_event_of_a_kind_it_had_is_not_counted_again() -> None:
    p = Side("prefill-0/tp0")
    events: list[Event] = [
        p.map("a", "r-1", blocks=(1,)),
        p.ack("a", "release"),  # released
        p.ack("a", "release"),  # late: found
        p.map("a", "r-2", blocks=(2,)),  # reused id: found
    ]
    later: list[Event] = [p.ack("a", "release", ts=p.ts + 100), p.map("a", "r-3", blocks=(3,)), p.ack("a", "read")]
    state = LedgerState()
    for event in events:
        state.apply(event)
    assert state.found_by_code == {"late_event": 1, "id_reuse": 1}
    assert state.forget_decided(p.ts + 1) == 1 and not state.transfers  # compacted, evidence and all
    assert audit(state, p.ts) == []  # what is open now no longer says it
    restored = snapshot.decode(snapshot.encode(state))  # the tombstone keeps the kinds through a snapshot
    for s in (state, restored):
        for event in later:
            s.apply(event)
        assert s.found_by_code == {"late_event": 1, "id_reuse": 1}
        assert {f.code for f in audit(s, p.ts)} == {"late_event", "id_reuse"}  # the new evidence is reported
    assert _offline([*events, *later]) == {"late_event": 1, "id_reuse": 1}


def test_an_expired_orphan_is_found_once_whatever_comes_after() -> None:
    p = Side("prefill-0/tp0")
    state = LedgerState()
    state.apply(p.ack("o", "release"))
    state.apply(p.expire("o", "transfer"))
    assert state.found_by_code == {"orphan_ack": 1}
    state.forget_decided(p.ts + 1)
    assert not state.transfers and state.orphan_tombstones
    state.apply(p.expire("o", "transfer"))  # recalled: expired twice, nothing new
    state.apply(p.map("o", "r-1", blocks=(1,)))  # mapped after its expiry: late, released at once
    assert state.found_by_code == {"orphan_ack": 1, "late_event": 1}
