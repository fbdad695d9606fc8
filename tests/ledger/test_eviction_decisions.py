"""The horizon rule decides alike whether a side is held whole, as a tombstone, or retired by the memory
bound: a decided side is judged in full until an event comes more than `side_horizon_s` after its last
event; that event finds it retired (a map of a mapped side's id refused, anything else counted; a
never-mapped side's key new again). Retired by time, never by count: a burst of other transfers changes
no answer about this one."""

from __future__ import annotations

from ledger.audit import audit
from ledger.events import Event
from ledger.fold import LedgerState
from ledger.limits import ARRIVAL_LAG_S, SIDE_HORIZON_S
from ledger.summary import compaction_warning
from tests.ledger.builders import Side

P = "prefill-0/tp0"


def _fold(events: list[Event], *, forget_every: int | None) -> tuple[LedgerState, list[object]]:
    """Fold `events`, forgetting (compacting and retiring) every `forget_every` events, or never."""
    state = LedgerState()
    out: list[object] = []
    for i, e in enumerate(events, 1):
        out.append(state.apply(e))
        if forget_every and i % forget_every == 0:
            state.forget_decided(e.ts - 1.0)
    return state, out


def _codes(state: LedgerState, now: float) -> list[tuple[str, str]]:
    return [(f.code, f.transfer_id) for f in audit(state, now)]


def test_a_late_event_within_the_horizon_is_judged_and_past_it_only_counted_in_every_mode() -> None:
    p = Side(P, step_s=1.0)
    events = [p.map("tx-a", "p-a", blocks=(1,)), p.ack("tx-a", "release")]
    events.append(p.ack("tx-a", "release", rank=1, ts=p.ts + SIDE_HORIZON_S / 2))  # late, within: judged
    for i in range(50):  # other traffic, long after
        events += [p.map(f"tx-{i}", f"p-{i}", blocks=(i + 10,), ts=p.ts + 60.0), p.ack(f"tx-{i}", "release")]
    events.append(p.map("tx-a", "p-again", blocks=(2,), ts=p.ts + 10.0))  # far past tx-a's horizon
    events.append(p.ack("tx-a", "recv"))
    runs = [_fold(events, forget_every=n) for n in (None, 1, 7)]
    assert [out for _, out in runs[1:]] == [runs[0][1]] * 2
    now = events[-1].ts
    assert [_codes(state, now) for state, _ in runs[1:]] == [_codes(runs[0][0], now)] * 2
    for state, _ in runs:
        assert (state.reused_after_horizon, state.late_after_horizon, state.behind_horizon) == (1, 1, 0)
        assert state.was_mapped((P, "tx-a")) and (P, "tx-a") not in state.live  # refused: never held again
    compacted = runs[1][0]
    assert compacted.tombstones_retired >= 10 and compacted.id_memory is not None  # retired by time, exactly
    assert compaction_warning(compacted) is None


def test_an_orphan_is_decided_by_its_early_events_within_its_horizon_and_is_new_past_it() -> None:
    p = Side(P, step_s=1.0)
    early = [p.ack("orphan", "release"), p.expire("orphan", "transfer")]
    within = p.map("orphan", "p-late", blocks=(9,), ts=p.ts + 30.0)
    for forget in (False, True):
        state = LedgerState()
        for e in early:
            state.apply(e)
        if forget:
            state.forget_decided(p.ts + 1.0)
            assert state.tombstone_count == 1
        release = state.apply(within)
        assert release is not None and release.why == "expired_before_map"
    q = Side(P, step_s=1.0)
    early = [q.ack("orphan", "release"), q.expire("orphan", "transfer")]
    past = q.map("orphan", "p-late", blocks=(9,), ts=q.ts + SIDE_HORIZON_S + 1.0)
    for forget_ts in (None, q.ts + 1.0, q.ts + SIDE_HORIZON_S + ARRIVAL_LAG_S + 10.0):
        state = LedgerState()
        for e in early:
            state.apply(e)
        if forget_ts is not None:
            state.forget_decided(forget_ts)
            state.forget_decided(forget_ts)  # a second pass retires the older generation
        assert state.apply(past) is None and (P, "orphan") in state.live  # a fresh transfer: held
        assert not state.was_mapped((P, "tx-never"))


def test_an_event_too_far_behind_for_the_memory_bound_is_counted_and_the_replay_warns() -> None:
    p = Side(P, step_s=1.0)
    state = LedgerState()
    for e in [p.map("tx-a", "p-a", blocks=(1,)), p.ack("tx-a", "release")]:
        state.apply(e)
    decided_ts = p.ts
    far = decided_ts + 2 * (SIDE_HORIZON_S + ARRIVAL_LAG_S) + 100.0
    state.forget_decided(far)
    state.forget_decided(far)
    assert state.tombstone_count == 0 and state.tombstones_retired == 1
    # An ack stamped inside tx-a's horizon, arriving only now: its tombstone is gone.
    state.apply(p.ack("tx-a", "release", rank=1, ts=decided_ts + 5.0))
    assert (state.behind_horizon, state.late_after_horizon) == (1, 1)
    warning = compaction_warning(state)
    assert warning is not None and warning.startswith("1 events for retired transfer sides")
