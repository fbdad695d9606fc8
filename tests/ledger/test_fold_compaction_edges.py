"""The edges of the fold's compaction calls and counters: which sides `compact` and `forget_decided` take
at their limits, what the counts of compacted sides and evicted keys say, and that the tombstone bound
holds for any size."""

from __future__ import annotations

from kvledger.ledger.audit import audit
from kvledger.ledger.events import Event
from kvledger.ledger.fold import LedgerState, fold, fold_all
from kvledger.ledger.store import snapshot
from tests.ledger.builders import Side

P = "prefill-0/tp0"
T = "tx-1"


def _clean(p: Side, n: int, *, mode: str = "read") -> list[Event]:
    events: list[Event] = []
    for i in range(n):
        tid = f"tx-{i}"
        if mode == "read":
            events += [p.map(tid, f"p-{i}", blocks=(i,)), p.ack(tid, "release")]
        else:
            events += [p.map(tid, f"p-{i}", "producer", "write", blocks=(i,)), p.seal(tid, 0)]
    return events


def test_compact_keeps_the_sides_of_a_source_it_has_no_persisted_seq_for() -> None:
    p, q = Side(P), Side("prefill-1/tp0")
    state, _ = fold_all([*_clean(p, 2), *_clean(q, 1)])
    assert state.compact({q.source: q.seq}) == 1
    assert sorted(k[0] for k in state.transfers) == [P, P] and state.tombstone_count == 1


def test_compact_takes_decided_sides_behind_a_live_one_and_keeps_forget_decided_and_snapshots_working() -> None:
    p = Side(P, start_ts=0.0, step_s=1.0)
    state, _ = fold_all([p.map("live", "p-live", blocks=(99,)), *_clean(p, 3)])
    assert state.compact(decided_before_ts=p.ts) == 2  # the side decided at exactly that time stays
    assert set(k[1] for k in state.transfers) == {"live", "tx-2"}
    assert [(source, tid) for _, source, tid, _ in state.decided] == [(P, "tx-2")]
    restored = snapshot.decode(snapshot.encode(state))
    assert snapshot.encode(restored) == snapshot.encode(state)
    assert state.forget_decided(before_ts=p.ts + 1) == 1 and set(k[1] for k in state.transfers) == {"live"}
    assert state.compacted_by_phase == {"completed": 3} and state.compacted_by_mode == {"read": 3}


def test_compacted_sides_are_counted_by_phase_and_mode() -> None:
    p = Side(P)
    events = _clean(p, 3)
    events += [p.map("w0", "p-w0", "producer", "write", blocks=(50,)), p.seal("w0", 0)]
    events += [p.map("w1", "p-w1", "producer", "write", blocks=(51,)), p.fail("w1", "boom")]
    state, _ = fold_all(events)
    assert state.forget_decided(before_ts=p.ts + 1) == 5
    assert state.compacted_by_phase == {"completed": 4, "failed": 1}
    assert state.compacted_by_mode == {"read": 3, "write": 2}


def test_a_late_event_keeps_a_side_whole_a_little_longer_even_when_evidence_is_not_kept() -> None:
    p = Side(P, start_ts=0.0, step_s=1.0)
    state, _ = fold_all(_clean(p, 2))  # decided at ts 2 and 4
    state.apply(p.ack("tx-0", "release", rank=1, ts=20.0))  # late
    assert state.forget_decided(before_ts=10.0) == 1
    assert set(k[1] for k in state.transfers) == {"tx-0"}
    assert state.forget_decided(before_ts=21.0) == 1 and not state.transfers


def test_the_tombstone_bound_holds_for_an_odd_size() -> None:
    p = Side(P)
    state = LedgerState()
    state.tombstones_max = 5
    for event in _clean(p, 12):
        state.apply(event)
    assert state.forget_decided(before_ts=p.ts + 1) == 12
    # Generations of 5 // 2 = 2: the twelfth turns the sixth over, five full ones evicted before it.
    assert state.tombstone_count == 2 and state.tombstones_evicted == 10


def test_events_past_the_bound_are_counted_by_kind() -> None:
    p = Side(P)
    state = LedgerState()
    state.tombstones_max = 2
    for event in _clean(p, 4):
        state.apply(event)
    state.forget_decided(before_ts=p.ts + 1)
    assert state.tombstones_evicted >= 2 and (P, "tx-0") not in state.tombstones_old
    again = [p.map("tx-0", "p-again"), p.map("tx-0", "p-3rd")]
    again += [p.ack("tx-0", "release", rank=1), p.ack("tx-0", "recv"), p.expire("tx-0")]
    assert [state.apply(event) for event in again] == [None] * 5
    assert (state.late_after_eviction, state.reused_after_eviction) == (3, 2)


def test_the_snapshot_view_names_every_field_and_the_values_read_from_events() -> None:
    p = Side(P)
    state, _ = fold_all([p.map("w", "p-w", "producer", "write", blocks=(4, 5)), p.schedule("w", (0, 2), op="write")])
    view = state.transfers[(P, "w")].snapshot()
    assert view["request_id"] == "p-w" and view["block_ids"] == (4, 5) and view["map_seq"] == 1
    assert view["first_seq"] == 1 and view["last_seq"] == 2 and view["scheduled"] == [0, 2]
    assert view["decision"] is None and view["phase"] == "active" and view["reused_by"] is None


def test_claimants_of_an_unknown_source_or_block_are_none() -> None:
    p = Side(P)
    state, _ = fold_all([p.map("a", "p-a", blocks=(1,))])
    assert state.claimants("nowhere", 1) == [] and state.claimants(P, 2) == []
    assert state.claimants(P, 1) == [(P, "a")]


def test_compact_clean_only_keeps_sides_with_evidence_and_takes_the_clean_ones_after_them() -> None:
    p = Side(P)
    events = [p.map("dup", "p-d", blocks=(7,)), p.ack("dup", "release"), p.ack("dup", "release"), *_clean(p, 2)]
    state, _ = fold_all(events)
    assert state.compact(clean_only=True) == 2
    assert list(state.transfers) == [(P, "dup")] and list(state.anomalous) == [(P, "dup")]


def test_a_recalled_side_is_the_decided_side_again_and_snapshots_round_trip() -> None:
    p = Side(P)
    state, _ = fold_all([p.map(T, "p-1", acks=2), p.ack(T, "release", rank=0), p.ack(T, "release", rank=1)])
    whole = state.transfers[(P, T)].snapshot()
    assert state.forget_decided(before_ts=p.ts + 1) == 1 and state.side((P, T)) is not None
    state.apply(p.ack(T, "release", rank=2))  # late: recalls the side
    recalled = state.transfers[(P, T)]
    assert recalled.late_seqs == [4] and recalled.last_seq == 4
    view = recalled.snapshot()
    for field in ("request_id", "block_ids", "acks_expected", "decision", "phase", "role", "mode", "map_seq"):
        assert view[field] == whole[field], field
    assert view["first_seq"] == whole["first_seq"] == 1 and view["events"] == whole["events"] + 1 == 4
    assert view["decision"]["cause"] == "completed" and view["decision"]["seq"] == 3
    restored = snapshot.decode(snapshot.encode(state))
    assert snapshot.encode(restored) == snapshot.encode(state)


def test_compact_takes_what_is_persisted_even_behind_a_side_that_is_not() -> None:
    p = Side(P)
    events = [*_clean(p, 2), p.ack("tx-0", "release", rank=1)]  # tx-0's late event is seq 5, not persisted
    state, _ = fold_all(events)
    assert state.compact({P: 4}) == 1 and list(state.transfers) == [(P, "tx-0")]


def test_forget_decided_keeps_a_side_whose_last_event_is_exactly_at_the_cut() -> None:
    p = Side(P, start_ts=0.0, step_s=1.0)
    state, _ = fold_all([*_clean(p, 1), p.ack("tx-0", "release", rank=1, ts=10.0)])
    assert state.forget_decided(before_ts=10.0) == 0 and (P, "tx-0") in state.transfers
    assert state.forget_decided(before_ts=10.0 + 1 / 64) == 1


def test_an_evicted_expired_producer_is_no_premature_release_candidate_any_more() -> None:
    p = Side(P)
    state = LedgerState()
    state.tombstones_max = 2
    events = [p.map("gone", "p-0", blocks=(1,)), p.expire("gone"), *_clean(p, 3)]
    for event in events:
        state.apply(event)
    assert list(state.expired_producers) == [(P, "gone")]
    state.forget_decided(before_ts=p.ts + 1)
    assert state.tombstones_evicted and (P, "gone") not in state.tombstones_old
    assert state.expired_producers == {}


def test_fold_all_continues_the_state_it_is_given() -> None:
    p = Side(P)
    state, first = fold_all([p.map(T, "p-1", acks=2), p.ack(T, "release", rank=0)])
    same, second = fold_all([p.ack(T, "release", rank=1)], state)
    assert same is state and first == [] and [r.cause for r in second] == ["completed"]


def test_compact_takes_old_sides_even_behind_one_with_a_recent_event() -> None:
    p = Side(P, start_ts=0.0, step_s=1.0)
    state, _ = fold_all([*_clean(p, 2), p.ack("tx-0", "release", rank=1, ts=20.0)])
    assert state.compact(decided_before_ts=10.0) == 1 and list(state.transfers) == [(P, "tx-0")]


def test_compact_takes_sides_with_evidence_unless_told_to_keep_them() -> None:
    p = Side(P)
    state, _ = fold_all([*_clean(p, 1), p.ack("tx-0", "release")])  # a late ack: evidence
    assert state.compact() == 1 and not state.transfers and not state.anomalous


def test_a_recalled_orphan_is_an_orphan_finding_again() -> None:
    p = Side(P)
    state, _ = fold_all([p.ack(T, "release"), p.expire(T, "transfer")])
    assert [f.code for f in audit(state, p.ts)] == ["orphan_ack"]
    assert state.forget_decided(before_ts=p.ts + 1) == 1 and audit(state, p.ts) == []
    state.apply(p.ack(T, "release", rank=1))  # late: recalls the whole orphan
    assert sorted(f.code for f in audit(state, p.ts)) == ["late_event", "orphan_ack"]


def test_fold_applies_one_event_to_the_state_it_returns() -> None:
    p = Side(P)
    state = LedgerState()
    assert fold(state, p.map(T, "p-1")) is state and list(state.live) == [(P, T)]
