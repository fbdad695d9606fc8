"""Past the tombstone bound, a running ledger must still take the decisions the whole history takes.

An orphan (events for a side never mapped) that expired is kept whole once compacted: a map arriving later
is decided "expired before its map arrived". Orphans are kept apart from the mapped sides' tombstones, under
a bound of their own, so the ordinary traffic that evicts tombstones never evicts them; and exactly (no
filter), because a false positive there would release a fresh transfer at once.
"""

from __future__ import annotations

from kvledger.ledger.fold import LedgerState, fold_all
from kvledger.ledger.idmemory import IdMemory
from kvledger.ledger.summary import compaction_report, compaction_warning
from tests.ledger.builders import Side


def test_a_map_after_an_orphan_is_decided_as_the_whole_history_decides_it_past_the_tombstone_bound() -> None:
    p = Side("prefill-0/tp0")
    events = [p.ack("orphan", "release"), p.expire("orphan", "transfer")]  # a release for a side never mapped
    for i in range(10):
        events += [p.map(f"tx-{i}", f"p-{i}", blocks=(i,)), p.ack(f"tx-{i}", "release")]
    late_map = p.map("orphan", "p-late", blocks=(99,))
    _, whole_history = fold_all([*events, late_map])

    state = LedgerState()
    state.tombstones_max = 4
    for event in events:
        state.apply(event)
    state.forget_decided(before_ts=p.ts + 1)
    key = (p.source, "orphan")
    assert state.tombstones_evicted and not state.orphans_evicted  # ordinary traffic evicts tombstones only
    assert not state.was_mapped(key)  # never mapped: not a reused id
    assert state.apply(late_map) == whole_history[-1]
    assert whole_history[-1].cause == "expired" and whole_history[-1].reason == "expired before its map arrived"
    assert not state.live and state.blocks_held == 0


def test_past_the_orphan_bound_a_late_map_is_a_fresh_transfer_and_it_is_counted() -> None:
    """The safe side of the bound: held until released or expired, never released at once on a guess."""
    p = Side("prefill-0/tp0")
    state = LedgerState()
    state.orphan_tombstones_max = 4
    for i in range(6):
        state.apply(p.ack(f"orphan-{i}", "release"))
        state.apply(p.expire(f"orphan-{i}", "transfer"))
    state.forget_decided(before_ts=p.ts + 1)
    assert state.orphans_evicted == 4 and state.side((p.source, "orphan-0")) is None
    assert state.apply(p.map("orphan-0", "p-late", blocks=(9,))) is None
    assert (p.source, "orphan-0") in state.live
    assert state.apply(p.map("orphan-5", "p-late-5", blocks=(10,))).cause == "expired"  # still held: exact


def test_fresh_keys_are_not_taken_for_evicted_orphans() -> None:
    p = Side("prefill-0/tp0")
    state = LedgerState()
    state.orphan_tombstones_max = 4
    for i in range(10):
        state.apply(p.ack(f"orphan-{i}", "release"))
        state.apply(p.expire(f"orphan-{i}", "transfer"))
    state.forget_decided(before_ts=p.ts + 1)
    assert state.orphans_evicted
    assert state.apply(p.map("fresh", "p-1", blocks=(5,))) is None  # held, as any first map
    assert (p.source, "fresh") in state.live
    assert state.id_memory is None  # orphans are never in the id memory: no false positive can release
    assert not isinstance(state.id_memory, IdMemory)


def test_past_the_orphan_bound_the_warning_names_the_sides_whose_decisions_are_not_exact() -> None:
    """The bounded ledger decides a late map of an evicted orphan otherwise than the whole history: the warning
    must not call that exact, and it counts every side first seen after the eviction (any may be such a map)."""
    p = Side("prefill-0/tp0")
    orphans = [e for i in range(6) for e in (p.ack(f"orphan-{i}", "release"), p.expire(f"orphan-{i}", "transfer"))]
    later = [p.map("orphan-0", "p-late", blocks=(9,)), p.map("fresh", "p-1", blocks=(5,))]
    whole, whole_releases = fold_all([*orphans, *later])
    bounded = LedgerState()
    bounded.orphan_tombstones_max = 4
    for event in orphans:
        bounded.apply(event)
    bounded.forget_decided(before_ts=p.ts + 1)
    assert compaction_warning(bounded) == (
        "memory bound hit: 4 never-mapped sides evicted past 4, their ids forgotten: no side was first seen after "
        "that; so every finding and decision is exact"
    )
    bounded_releases = [r for r in (bounded.apply(e) for e in later) if r is not None]
    assert whole_releases[-1].transfer_id == "orphan-0" and whole_releases[-1].cause == "expired"
    assert bounded_releases == [] and (p.source, "orphan-0") in bounded.live  # decided otherwise
    report = compaction_report(bounded)
    assert (report["orphans_evicted"], report["sides_unchecked"]) == (4, 2)
    warning = compaction_warning(bounded)
    assert warning is not None
    assert "4 never-mapped sides evicted past 4" in warning
    assert "2 sides first seen after that could not be checked against them" in warning
    assert warning.endswith("so the decisions and findings about those are not exact")
    assert compaction_warning(whole) is None and compaction_report(whole)["sides_unchecked"] == 0


def test_past_the_tombstone_bound_the_warning_counts_what_was_not_judged() -> None:
    p = Side("prefill-0/tp0")
    state = LedgerState()
    state.tombstones_max = 4
    for i in range(6):
        state.apply(p.map(f"tx-{i}", f"p-{i}", blocks=(i,)))
        state.apply(p.ack(f"tx-{i}", "release"))
    state.forget_decided(before_ts=p.ts + 1)
    assert state.tombstones_evicted == 4
    assert compaction_warning(state) == (
        "memory bound hit: 4 compacted transfer sides evicted past 4 tombstones: no later event fell on them; so "
        "every finding and decision is exact"
    )
    state.apply(p.ack("tx-0", "release"))  # late, for an evicted side: counted, not judged
    warning = compaction_warning(state)
    assert warning is not None and "1 later events for them were counted, not judged" in warning
    assert warning.endswith("not exact")
