"""However much traffic came before, a running ledger takes the decisions the whole history takes: nothing
is evicted by count, and no decision rests on a probabilistic structure (DESIGN.md, "Long runs").

An orphan (events for a side never mapped) that expired is kept whole once compacted: a map arriving later
inside its id's window is decided "expired before its map arrived", after any amount of other traffic. A
fresh id is never taken for a used one. The only answer that may not be exact, an event behind the horizon
of retired stamped ids, is counted and named by the warning.
"""

from __future__ import annotations

from kvledger.ledger.fold import LedgerState, fold_all
from kvledger.ledger.ids import stamped_id
from kvledger.ledger.limits import ID_WINDOW_S
from kvledger.ledger.summary import compaction_report, compaction_warning
from tests.ledger.builders import Side

TRAFFIC = 3000
"""Transfers folded and forgotten between an id's first events and its late ones: more than the old count
bounds the tests once set small (a few), and enough that a count bound of any size under it would show."""


def _traffic(p: Side, n: int, *, stamped: bool) -> list:  # type: ignore[type-arg]
    events = []
    for i in range(n):
        tid = stamped_id(p.ts, i) if stamped else f"tx-{i}"
        events += [p.map(tid, f"p-{i}", blocks=(i,)), p.ack(tid, "release")]
    return events


def _forgetting(events: list) -> tuple[LedgerState, list]:  # type: ignore[type-arg]
    state, releases = LedgerState(), []
    for n, event in enumerate(events, 1):
        release = state.apply(event)
        if release is not None:
            releases.append(release)
        if n % 50 == 0:
            state.forget_decided(event.ts - 1.0)
    return state, releases


def test_a_map_after_an_orphan_is_decided_as_the_whole_history_decides_it_after_any_traffic() -> None:
    for stamped in (False, True):
        p = Side("prefill-0/tp0", start_ts=5000.0)
        orphan = stamped_id(p.ts, 10**6) if stamped else "orphan"
        events = [p.ack(orphan, "release"), p.expire(orphan, "transfer"), *_traffic(p, TRAFFIC, stamped=stamped)]
        events.append(p.map(orphan, "p-late", blocks=(10**6,)))
        _, whole_history = fold_all(events)
        state, releases = _forgetting(events)
        assert releases == whole_history
        assert releases[-1].transfer_id == orphan and releases[-1].why == "expired_before_map"
        assert compaction_warning(state) is None


def test_a_fresh_id_after_any_traffic_is_never_taken_for_a_used_one() -> None:
    p = Side("prefill-0/tp0", start_ts=5000.0)
    events = _traffic(p, TRAFFIC, stamped=False)
    fresh = p.map("tx-fresh", "p-fresh", blocks=(10**6,))
    state, _ = _forgetting([*events, fresh])
    assert not state.was_mapped((p.source, "tx-never")) and (p.source, "tx-fresh") in state.live
    state.forget_decided(p.ts + 1)
    assert state.tombstone_count == state.unstamped_held == TRAFFIC  # unstamped: all held, exactly
    assert compaction_report(state)["unstamped_held"] == TRAFFIC
    assert all(state.was_mapped((p.source, f"tx-{i}")) for i in range(TRAFFIC))


def test_behind_the_horizon_the_warning_counts_what_may_not_be_exact() -> None:
    p = Side("prefill-0/tp0", start_ts=5000.0)
    tid = stamped_id(5000.0, 1)
    state = LedgerState()
    state.apply(p.map(tid, "p-1", blocks=(1,)))
    state.apply(p.ack(tid, "release"))
    state.forget_decided(before_ts=p.ts + 1)
    assert compaction_warning(state) is None
    state.forget_decided(before_ts=5000.0 + ID_WINDOW_S + state.arrival_lag_s + 10)  # retires it
    assert compaction_warning(state) is None  # retiring alone changes no answer
    state.apply(p.ack(tid, "release", rank=1, ts=5000.0 + ID_WINDOW_S - 1))  # inside the window, far behind
    assert state.behind_horizon == 1 and compaction_report(state)["behind_horizon"] == 1
    warning = compaction_warning(state)
    assert warning is not None and "1 events arrived more than 300 s behind" in warning
    assert warning.endswith("not exact")
