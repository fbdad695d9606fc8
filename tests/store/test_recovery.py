"""Recovery: a reopened ledger continues with the same state and gapless seqs; snapshot + tail = full refold."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from kvledger.ledger.audit import audit
from kvledger.ledger.events import Event
from kvledger.ledger.fold import LedgerState, fold_all
from kvledger.ledger.jsonl import write_log
from kvledger.ledger.ledger import Ledger
from kvledger.ledger.store import snapshot
from kvledger.ledger.store.base import EventStore
from kvledger.ledger.store.recovery import load_state, open_ledger, save_snapshot, snapshot_source
from kvledger.ledger.synth import SynthConfig, generate
from tests.ledger.builders import Side
from tests.store.conftest import ROW_BACKENDS, backend_url

PRODUCER = "prefill-0/tp0"


@pytest.fixture(params=ROW_BACKENDS)
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Every backend but NATS (tests/store/conftest.py's ROW_BACKENDS says why)."""
    return backend_url(request, tmp_path)


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


def test_a_gap_in_the_stored_log_is_reported_and_folded_over(store: EventStore) -> None:
    events = _producer_events(30)
    store.append(events[:5] + events[6:10] + events[12:15])
    store.append([events[11]])  # a remote appender filling part of a hole later
    recovered = load_state(store, PRODUCER)
    assert recovered.gaps == [(6, 6), (11, 11)] and recovered.last_seq == 15 and recovered.folded == 13
    ledger = open_ledger(store, PRODUCER)
    assert ledger.log.next_seq == 16


def test_a_stored_event_the_fold_finds_odd_does_not_stop_recovery(store: EventStore) -> None:
    """The poison pill of issue 14: a map naming a block twice, two more claimants, then the first
    decided. It once raised inside the fold, so the connector could not restart on its own store."""
    p = Side(PRODUCER)
    events = [p.map("a", "ra", blocks=(2, 2)), p.map("b", "rb", blocks=(2,)), p.map("c", "rc", blocks=(2,))]
    store.append([*events, p.expire("a")])
    ledger = open_ledger(store, PRODUCER)
    assert ledger.log.next_seq == 5
    assert sorted(ledger.state.claimants(PRODUCER, 2)) == [(PRODUCER, "b"), (PRODUCER, "c")]
    assert {f.code for f in audit(ledger.state, p.ts)} >= {"duplicate"}


def test_a_quarantined_seq_is_never_given_out_again(store: EventStore) -> None:
    events = _producer_events(30)
    store.append(events[:10])
    store.quarantine([(msgspec.structs.replace(events[10], ts=9e11), "UnstorableEvent: field 'ts'")])
    ledger = open_ledger(store, PRODUCER)
    assert ledger.log.next_seq == 12  # seq 11 is the quarantined event's, even though the store never held it


def test_fresh_store_gives_a_fresh_ledger(store: EventStore) -> None:
    ledger = open_ledger(store, PRODUCER)
    assert isinstance(ledger, Ledger) and ledger.log.next_seq == 1 and not ledger.state.transfers


def test_spilled_events_after_a_hole_are_loaded_and_the_gap_reported(store: EventStore, tmp_path: Path) -> None:
    """Events lost before a durable spill file (only a failed spill write can do that now): every durable
    spilled event is loaded exactly once, in order, and the hole is reported rather than fatal."""
    events = _producer_events()
    source = events[0].source
    mine = [e for e in events if e.source == source]
    store.append(mine[:10])
    spill = tmp_path / "spill"
    spill.mkdir()
    # Seqs 11..14 were lost; the spill file after them survived (its first event is already stored too).
    write_log(spill / "spill-00000000000000000001-000001.jsonl", [mine[9], *mine[14:20]])
    ledger = open_ledger(store, source, spill_dir=spill)
    assert [e.seq for e in store.read(source=source)] == [*range(1, 11), *range(15, 21)]
    assert load_state(store, source).gaps == [(11, 14)]
    assert ledger.log.next_seq == 21
    assert not list(spill.glob("*.jsonl"))
