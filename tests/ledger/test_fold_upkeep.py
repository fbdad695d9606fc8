"""The fold's compact representation and upkeep: layer and rank bitmasks, bounded tombstones,
forgetting decided sides in O(1), and a snapshot of all of it."""

from __future__ import annotations

import msgspec
import pytest

import kvledger.ledger.upkeep as upkeep_module
from kvledger.ledger.audit import audit, counts_by_code
from kvledger.ledger.events import Ack
from kvledger.ledger.fold import LedgerState, fold_all
from kvledger.ledger.limits import LAYERS_MAX, RANKS_MAX
from kvledger.ledger.side import bits, copies, layers_mask
from kvledger.ledger.store import snapshot
from kvledger.ledger.transfer_state import TransferState
from tests.ledger.builders import Side

T = "tx-1"


def test_bits_and_layers_mask_round_trip() -> None:
    layers = (0, 3, 63, 64, 200)
    assert bits(layers_mask(layers)) == set(layers)
    assert layers_mask(()) == 0 and bits(0) == set()
    assert layers_mask((1, -1)) == -1
    assert layers_mask((LAYERS_MAX,)) == -1


def test_layer_and_rank_numbers_out_of_range_are_evidence_not_state() -> None:
    p = Side("prefill-0/tp0")
    state = LedgerState()
    events = [
        p.map(T, "p-1", "producer", "write", acks=2),
        p.schedule(T, (0, 1), op="write"),
        p.schedule(T, (LAYERS_MAX,), op="write"),  # no model has this layer
        p.ack(T, "write", (-3,)),
        p.ack(T, "release", rank=RANKS_MAX),  # no such rank
        p.ack(T, "release", rank=-1),
    ]
    assert [state.apply(e) for e in events] == [None] * len(events)
    t = state.transfers[(p.source, T)]
    assert t.scheduled == {0, 1} and t.acked == set() and t.release_ranks == set()
    assert t.over_ack_seqs == [3, 4, 5, 6]
    assert counts_by_code(audit(state, now=p.ts))["over_ack"] == 1
    # The side still completes on its real evidence.
    assert state.apply(p.ack(T, "write", (0, 1))) is None
    release = state.apply(p.seal(T, 2))
    assert release is not None and release.cause == "completed"


def test_an_ack_or_a_schedule_naming_no_layers_changes_nothing_and_is_no_evidence() -> None:
    c = Side("decode-0/tp0")
    state = LedgerState()
    events = [c.map(T, "c-1", "consumer", "read", remote=(1, 2, 3)), c.schedule(T, ()), c.ack(T, "read", ())]
    assert [state.apply(e) for e in events] == [None] * 3
    t = state.transfers[(c.source, T)]
    assert t.live and t.phase == "active" and t.acked == set() and not t.has_anomaly


def test_the_inline_write_path_and_the_handlers_agree() -> None:
    """Acks that complete, duplicate or run ahead of their schedule leave the fast path for the
    handler: the outcome is the same as one event at a time through the general rules."""
    p = Side("prefill-0/tp0")
    state, releases = fold_all(
        [
            p.map(T, "p-1", "producer", "write"),
            p.schedule(T, (0, 1), op="write"),
            p.ack(T, "write", (0, 1)),
            p.ack(T, "write", (1,)),  # duplicate
            p.ack(T, "write", (2,)),  # before its schedule
            p.schedule(T, (2, 3), op="write"),  # adopts the early ack of layer 2
            p.seal(T, 4),
            p.ack(T, "write", (3,)),  # completes
        ]
    )
    t = state.transfers[(p.source, T)]
    assert [(r.cause, r.seq) for r in releases] == [("completed", 8)]
    assert t.acked == {0, 1, 2, 3} and t.early_acks == set()
    assert t.duplicate_seqs == [4] and t.over_ack_seqs == [5]


def test_tombstones_are_bounded_in_two_generations_and_eviction_is_counted() -> None:
    p = Side("prefill-0/tp0")
    events = []
    for i in range(10):
        events += [p.map(f"tx-{i}", f"p-{i}", blocks=(i,)), p.ack(f"tx-{i}", "release")]
    state = LedgerState()
    state.tombstones_max = 8
    releases = [r for r in map(state.apply, events) if r is not None]
    assert len(releases) == 10
    assert state.forget_decided(before_ts=p.ts + 1) == 10
    assert not state.transfers
    assert state.tombstone_count <= 8 and state.tombstones_evicted == 10 - state.tombstone_count
    assert (p.source, "tx-9") in state.tombstones
    # tx-5 is remembered (older generation): its late ack is judged on the recalled side.
    assert state.apply(p.ack("tx-5", "release", rank=1)) is None
    assert state.transfers[(p.source, "tx-5")].late_seqs is not None and not state.unmapped
    # tx-0 is past the bound: the id memory still knows it was mapped, so its late ack is
    # counted (not an orphan) and a second map of its id is refused, both reported.
    assert state.was_mapped((p.source, "tx-0"))
    state.apply(p.ack("tx-0", "release", rank=1))
    assert state.apply(p.map("tx-0", "p-again", blocks=(77,))) is None
    assert (p.source, "tx-0") not in state.transfers and not state.unmapped and not state.live
    assert (state.late_after_eviction, state.reused_after_eviction) == (1, 1)
    assert not state.was_mapped((p.source, "tx-never"))


def test_forget_decided_keeps_evidence_when_asked_and_late_events_delay_it() -> None:
    p = Side("prefill-0/tp0", start_ts=0.0, step_s=1.0)
    state, _ = fold_all(
        [
            p.map("clean", "p-1"),
            p.ack("clean", "release"),  # decided at ts 2
            p.map("dup", "p-2", blocks=(7,)),
            p.ack("dup", "release"),  # decided at ts 4
            p.ack("dup", "release"),  # late at ts 5: evidence
            p.map("slow", "p-3", blocks=(8,)),
            p.ack("slow", "release"),  # decided at ts 7
        ]
    )
    state.apply(p.ack("slow", "release", rank=1, ts=20.0))  # late: the side stays visible longer
    assert state.forget_decided(before_ts=10.0, keep_evidence=True) == 1
    assert set(k[1] for k in state.transfers) == {"dup", "slow"}
    assert state.forget_decided(before_ts=10.0, keep_evidence=True) == 0
    assert state.forget_decided(before_ts=30.0, keep_evidence=True) == 0  # "slow" has a late event now
    assert set(k[1] for k in state.transfers) == {"dup", "slow"}
    assert state.compacted_by_phase == {"completed": 1}


def test_an_orphan_expired_then_mapped_is_forgotten_once() -> None:
    p = Side("prefill-0/tp0")
    state, releases = fold_all([p.ack(T, "release"), p.expire(T, "transfer"), p.map(T, "p-1")])
    assert [r.cause for r in releases] == ["expired"]
    assert len(state.decided) == 1  # the orphan-expiry entry gave way to the decision's
    assert state.forget_decided(before_ts=p.ts + 1) == 1
    assert state.forget_decided(before_ts=p.ts + 1) == 0 and not state.transfers


def test_snapshot_round_trips_masks_and_both_tombstone_generations(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(upkeep_module, "TOMBSTONES_MAX", 4)  # read when the state is made
    p = Side("prefill-0/tp0")
    events = [p.map("w", "p-w", "producer", "write", blocks=(50,)), p.schedule("w", (0, 2, 70), op="write")]
    events.append(p.ack("w", "write", (2,)))
    for i in range(5):
        events += [p.map(f"tx-{i}", f"p-{i}", blocks=(i,), acks=2), p.ack(f"tx-{i}", "release", rank=1)]
        events.append(p.ack(f"tx-{i}", "release", rank=0))
    state, _ = fold_all(events)
    state.forget_decided(before_ts=p.ts + 1)
    assert state.tombstones and state.tombstones_old
    restored = snapshot.decode(snapshot.encode(state))
    assert snapshot.encode(restored) == snapshot.encode(state)
    w = restored.transfers[(p.source, "w")]
    assert w.scheduled == {0, 2, 70} and w.acked == {2}
    assert restored.tombstones == state.tombstones and restored.tombstones_old == state.tombstones_old
    # The restored state folds on exactly as the original does.
    more = [p.ack("w", "write", (0, 70)), p.seal("w", 3), p.ack("tx-1", "release", rank=0)]
    assert [restored.apply(e) for e in more] == [state.apply(e) for e in more]


def test_a_sides_first_event_is_its_map_or_the_event_seen_before_it_and_a_snapshot_keeps_both() -> None:
    p = Side("prefill-0/tp0")
    state, _ = fold_all([p.map("m", "p-1"), p.ack("o", "read"), p.map("o", "p-2")])
    m, o = state.transfers[(p.source, "m")], state.transfers[(p.source, "o")]
    assert m.first is None and (m.first_seq, m.first_ts) == (m.map_seq, m.map_event.ts)  # type: ignore[union-attr]
    assert isinstance(o.first, Ack) and (o.first_seq, o.first_ts) == (o.first.seq, o.first.ts)
    assert o.first_seq < o.map_seq
    restored = snapshot.decode(snapshot.encode(state))
    for key in ((p.source, "m"), (p.source, "o")):
        assert restored.transfers[key].snapshot() == state.transfers[key].snapshot()
        assert restored.transfers[key].first == state.transfers[key].first
    assert snapshot.encode(restored) == snapshot.encode(state)


def test_sides_with_transient_failures_are_indexed_until_decided() -> None:
    p = Side("decode-0/tp0")
    state = LedgerState()
    state.apply(p.fail("orphan", retryable=True))
    for event in (p.map(T, "c-1", "consumer", "read", remote=(1, 2, 3)), p.fail(T, "queue full", retryable=True)):
        state.apply(event)
    assert list(state.retrying) == [(p.source, "orphan"), (p.source, T)]
    assert all(state.retrying[key] is state.transfers[key] for key in state.retrying)
    restored = snapshot.decode(snapshot.encode(state))
    assert restored.retrying == {k: restored.transfers[k] for k in state.retrying}
    assert state.apply(p.ack(T, "read")) is not None
    state.apply(p.expire("orphan", "transfer"))
    assert state.retrying == {}


def test_a_side_whose_numbers_do_not_fit_a_tombstone_stays_whole() -> None:
    """No valid event has an integer past 64 bits, but the fold takes any well-typed event and never raises:
    such a side is simply not compacted (evidence of an odd appender), and a later event is judged on it."""
    p = Side("prefill-0/tp0")
    state, _ = fold_all([p.map("wide", "p-1", blocks=(1 << 70,)), p.ack("wide", "release")])
    assert state.forget_decided(before_ts=p.ts + 1) == 0
    assert (p.source, "wide") in state.transfers and state.tombstone_count == 0
    state.apply(p.ack("wide", "release", rank=1))
    assert state.transfers[(p.source, "wide")].late_seqs == [3]


def test_a_sides_copy_shares_no_list_the_fold_grows_in_place() -> None:
    """`copies` (what a snapshot encodes while the fold goes on) copies every list field a side has: one
    added to TransferState without being copied there fails here."""
    lists = [f.name for f in msgspec.structs.fields(TransferState) if "list[" in str(f.type)]
    assert len(lists) >= 5
    side = TransferState(source="prefill-0/tp0", **{name: [1, 2] for name in lists})  # type: ignore[arg-type]
    (copy,) = copies([side])
    for name in lists:
        assert getattr(copy, name) == getattr(side, name) and getattr(copy, name) is not getattr(side, name), name
    assert copy == side and copy is not side
