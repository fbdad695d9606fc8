"""Recovery: a reopened ledger continues with the same state and gapless seqs; snapshot + tail = full refold."""

from __future__ import annotations

from pathlib import Path

import pytest

from ledger.events import Event
from ledger.fold import LedgerState, fold_all
from ledger.jsonl import read_events, write_log
from ledger.ledger import Ledger
from ledger.store import snapshot
from ledger.store.base import EventStore, StoreError
from ledger.store.recovery import load_state, open_ledger, save_snapshot, snapshot_source
from ledger.synth import SynthConfig, generate

PRODUCER = "prefill-0/tp0"


def _producer_events(transfers: int = 400) -> list[Event]:
    cfg = SynthConfig(transfers=transfers, fault_rate=0.3, concurrency=32)
    return [e for e in generate(cfg, seed=11) if e.source == PRODUCER]


def _view(state: LedgerState) -> dict[object, object]:
    return {key: t.snapshot() for key, t in state.transfers.items()}


def test_reopened_ledger_continues_state_and_seq(store: EventStore) -> None:
    events = _producer_events(100)
    store.append(events[:200])
    ledger = open_ledger(store, PRODUCER)
    assert ledger.log.next_seq == 201
    expected, _ = fold_all(events[:200])
    assert _view(ledger.state) == _view(expected)
    for event in events[200:]:
        ledger.append(event)  # the same seqs the stream carries: gapless continuation
    full, _ = fold_all(events)
    assert _view(ledger.state) == _view(full)


def test_snapshot_plus_tail_equals_full_refold(store: EventStore) -> None:
    events = _producer_events()
    cut = len(events) // 2
    store.append(events[:cut])
    stored = snapshot_source(store, PRODUCER)
    assert stored.seq == cut
    store.append(events[cut:])
    recovered = load_state(store, PRODUCER)
    assert recovered.snapshot_seq == cut and recovered.folded == len(events) - cut
    full, full_releases = fold_all(events)
    assert _view(recovered.state) == _view(full)
    assert snapshot.encode(recovered.state) == snapshot.encode(full)  # indexes and orders too
    # Decisions after the snapshot are the same releases in the same order.
    _, tail_releases = fold_all(events[cut:], snapshot.decode(stored.body))
    assert tail_releases == full_releases[len(full_releases) - len(tail_releases) :]
    assert sum(full.releases_by_cause.values()) > 0 and full.anomalous


def test_snapshot_roundtrip_every_cut() -> None:
    events = _producer_events(60)
    full, _ = fold_all(events)
    for cut in range(0, len(events), 17):
        head, _ = fold_all(events[:cut])
        resumed, _ = fold_all(events[cut:], snapshot.decode(snapshot.encode(head)))
        assert _view(resumed) == _view(full), f"cut at {cut}"


def test_long_tail_writes_a_snapshot(store: EventStore) -> None:
    events = _producer_events(50)
    store.append(events)
    open_ledger(store, PRODUCER, snapshot_tail_events_max=10)
    latest = store.latest_snapshot(PRODUCER)
    assert latest is not None and latest.seq == len(events)


def test_unreadable_snapshot_falls_back_to_full_refold(store: EventStore) -> None:
    events = _producer_events(30)
    store.append(events)
    save_snapshot(store, PRODUCER, LedgerState(), 5)
    store.save_snapshot(store.latest_snapshot(PRODUCER)._replace(body=b"\x81\xa6format\x63"))  # type: ignore[union-attr]
    full, _ = fold_all(events)
    assert _view(load_state(store, PRODUCER).state) == _view(full)


def test_gap_in_the_stored_log_is_an_error(store: EventStore) -> None:
    events = _producer_events(30)
    store.append(events[:5] + events[6:10])
    with pytest.raises(StoreError, match="gap"):
        load_state(store, PRODUCER)


def test_fresh_store_gives_a_fresh_ledger(store: EventStore) -> None:
    ledger = open_ledger(store, PRODUCER)
    assert isinstance(ledger, Ledger) and ledger.log.next_seq == 1 and not ledger.state.transfers


def test_spilled_events_after_a_crash_hole_are_set_aside_and_the_log_continues(
    store: EventStore, tmp_path: Path
) -> None:
    events = _producer_events()
    source = events[0].source
    mine = [e for e in events if e.source == source]
    store.append(mine[:10])
    spill = tmp_path / "spill"
    spill.mkdir()
    # The crash lost seqs 11..14 (queued, never durable); the spill file after them survived.
    write_log(spill / "spill-00000000000000000001-000001.jsonl", mine[14:20])
    ledger = open_ledger(store, source, spill_dir=spill)
    assert [e.seq for e in store.read(source=source)] == list(range(1, 11))
    assert ledger.log.next_seq == 11
    orphaned = sorted(spill.glob("orphaned-*.jsonl"))
    assert len(orphaned) == 1 and [e.seq for e in read_events(orphaned[0])] == list(range(15, 21))
    assert not list(spill.glob("spill-*.jsonl"))
