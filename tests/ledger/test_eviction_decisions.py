"""Past the tombstone bound, a running ledger must still take the decisions the whole history takes.

An orphan (events for a side never mapped) that expired is kept whole as a tombstone: a map arriving later is
decided "expired before its map arrived". Once that tombstone is evicted, the id memory must still know the
key, or the later map is taken for a fresh transfer and decided differently from an offline replay.
"""

from __future__ import annotations

from ledger.fold import LedgerState, fold_all
from ledger.idmemory import IdMemory
from tests.ledger.builders import Side


def test_a_map_after_an_evicted_orphan_is_decided_as_the_whole_history_decides_it() -> None:
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
    assert state.tombstones_evicted and state.side(key) is None  # the orphan's tombstone is gone
    assert not state.was_mapped(key)  # never mapped: not a reused id
    assert state.apply(late_map) == whole_history[-1]
    assert whole_history[-1].cause == "expired" and whole_history[-1].reason == "expired before its map arrived"
    assert not state.live and state.blocks_held == 0


def test_fresh_keys_are_not_taken_for_evicted_orphans() -> None:
    p = Side("prefill-0/tp0")
    state = LedgerState()
    state.tombstones_max = 4
    for i in range(10):
        state.apply(p.ack(f"orphan-{i}", "release"))
        state.apply(p.expire(f"orphan-{i}", "transfer"))
    state.forget_decided(before_ts=p.ts + 1)
    assert state.tombstones_evicted
    assert state.apply(p.map("fresh", "p-1", blocks=(5,))) is None  # held, as any first map
    assert (p.source, "fresh") in state.live
    assert isinstance(state.id_memory, IdMemory)
