"""The store contract, one suite run against every backend (memory, SQLite, PostgreSQL, NATS JetStream)."""

from __future__ import annotations

import msgspec
import pytest

from kvledger.ledger.events import Ack, Event, TransferId, from_json
from kvledger.ledger.partition import partition_of
from kvledger.ledger.store.base import ConflictError, EventStore, StoredSnapshot, StoreError, UnstorableEvent
from kvledger.ledger.store.connect import open_store
from kvledger.ledger.synth import SynthConfig, generate
from tests.ledger.builders import Side
from tests.store.conftest import as_stored


def _events(transfers: int = 50) -> list[Event]:
    return list(generate(SynthConfig(transfers=transfers, concurrency=8), seed=7))


def test_append_and_read_back_in_order(store: EventStore) -> None:
    events = _events()
    assert store.append(events[:100]) == 100
    assert store.append(events[100:]) == len(events) - 100
    assert list(store.read()) == as_stored(store, events[:100], events[100:])
    assert store.count() == len(events)


def test_append_is_idempotent_by_source_and_seq(store: EventStore) -> None:
    events = _events()
    store.append(events[:60])
    assert store.append(events[40:80]) == 20  # the overlap is skipped, the rest inserted
    assert store.append(events[:80]) == 0
    assert list(store.read()) == as_stored(store, events[:60], events[60:80])


def test_conflicting_content_rejects_the_whole_batch(store: EventStore) -> None:
    events = _events()
    store.append(events[:10])
    changed = msgspec.structs.replace(events[5], ts=events[5].ts + 1)
    with pytest.raises(ConflictError, match="seq"):
        store.append([*events[10:20], changed])
    assert store.count() == 10  # nothing of the failed batch landed


def test_reads_by_seq_range_transfer_source_and_time(store: EventStore) -> None:
    events = _events()
    store.append(events)
    events = as_stored(store, events)
    source = events[0].source
    mine = [e for e in events if e.source == source]
    assert list(store.read(source=source)) == mine
    assert [e.seq for e in store.read(source=source, after_seq=5, until_seq=9)] == [6, 7, 8, 9]
    tid = events[0].transfer_id
    assert list(store.read(transfer_id=tid)) == [e for e in events if e.transfer_id == tid]
    low, high = events[20].ts, events[40].ts
    assert list(store.read(ts_from=low, ts_to=high)) == [e for e in events if low <= e.ts <= high]
    assert list(store.read(limit=3)) == events[:3]
    assert list(store.read(transfer_id=TransferId("no-such"))) == []


def test_a_transfer_s_drops_are_read_with_it(store: EventStore) -> None:
    """A `drop` names the transfer a forged message named. A NATS stream keeps it on partition 0's subjects
    (`partition_of_event`: partition 0 folds every drop), not its transfer's: read by transfer id (a
    timeline), with its source or without, it comes with the transfer's events, in store order."""
    producer, forger = Side("prefill-0/tp0"), Side("decode-9/tp0")
    away = next(f"tx-{i}" for i in range(100) if partition_of(f"tx-{i}", 4) != 0)  # the stream's 4 partitions
    home = next(f"tx-{i}" for i in range(100) if partition_of(f"tx-{i}", 4) == 0)
    batch: list[Event] = [
        producer.map(away, "r-1"), forger.drop(away), producer.map(home, "r-2"), forger.drop(home),
        producer.schedule(away), forger.drop(away, reason="unlisted"),
    ]  # fmt: skip
    store.append(batch)
    stored = as_stored(store, batch)
    for tid in (away, home):
        assert list(store.read(transfer_id=TransferId(tid))) == [e for e in stored if e.transfer_id == tid]
        dropped = [e for e in stored if e.transfer_id == tid and e.source == forger.source]
        assert dropped and list(store.read(transfer_id=TransferId(tid), source=forger.source)) == dropped


def test_tail_sources_and_cursors(store: EventStore) -> None:
    events = _events()
    store.append(events)
    events = as_stored(store, events)
    first = store.tail(0, limit=10)
    assert [e for _, e in first] == events[:10]
    cursors = [c for c, _ in first]
    assert cursors == sorted(cursors) and len(set(cursors)) == 10
    rest = store.tail(cursors[-1], limit=len(events))
    assert [e for _, e in rest] == events[10:]
    expected: dict[str, int] = {}
    for e in events:
        expected[e.source] = max(expected.get(e.source, 0), e.seq)
    assert store.sources() == expected


def test_tail_pages_of_any_size_read_the_store_once_in_order(store: EventStore) -> None:
    """Paging with `tail` from each page's last cursor, whatever the page size (a NATS page may begin inside a
    stored batch of events), reads every event once, in the store's order."""
    events = _events()
    for first in range(0, len(events), 37):  # several appends: several stored batches
        store.append(events[first : first + 37])
    whole = store.tail(0, limit=len(events))
    assert len(whole) == len(events)
    for limit in (1, 3, 7, 50):
        paged: list[tuple[int, Event]] = []
        while page := store.tail(paged[-1][0] if paged else 0, limit=limit):
            assert len(page) <= limit
            paged += page
        assert paged == whole


def test_many_sources_share_one_store(store: EventStore) -> None:
    batch = [Ack(seq=1, ts=1.0, source=f"decode-{i}/tp0", transfer_id=TransferId("t"), what="recv") for i in range(5)]
    assert store.append(batch) == 5
    assert set(store.sources()) == {f"decode-{i}/tp0" for i in range(5)}


def test_unassigned_seq_is_refused(store: EventStore) -> None:
    event = Ack(ts=1.0, source="p/tp0", transfer_id=TransferId("t"), what="recv")
    with pytest.raises(StoreError, match="no seq"):
        store.append([event])


@pytest.mark.parametrize(
    "change",
    [{"ts": 9e11}, {"source": "s" * 201}, {"transfer_id": "t\x00"}, {"seq": 1 << 64}],
    ids=["ts past 9999", "source wider than its column", "NUL in an id", "seq past 64 bits"],
)
def test_an_invalid_event_is_refused_naming_it_and_nothing_of_its_batch_lands(
    store: EventStore, change: dict[str, object]
) -> None:
    events = _events(5)
    bad = msgspec.structs.replace(events[3], **change)
    with pytest.raises(UnstorableEvent) as caught:
        store.append([*events[:3], bad, *events[4:]])
    assert caught.value.index == 3 and "field" in str(caught.value)
    assert store.count() == 0


def test_quarantine_keeps_refused_events_with_their_reason(store: EventStore) -> None:
    events = _events(5)
    odd = msgspec.structs.replace(events[1], source="p\x00/tp0", seq=1 << 70)
    assert store.quarantine([(events[0], "conflict"), (odd, "field 'seq': too big")]) == 2
    assert store.quarantine([(events[0], "conflict, seen again")]) == 0  # idempotent, like append
    assert store.quarantined_count() == 2
    first, second = store.quarantined()
    assert (first.source, first.seq, first.reason) == (events[0].source, events[0].seq, "conflict")
    assert from_json(first.body) == events[0]
    assert (second.source, second.seq) == ("p\ufffd/tp0", None)  # what every backend can hold
    assert b'"seq":1180591620717411303424' in second.body
    assert [q.seq for q in store.quarantined(source=events[0].source)] == [events[0].seq]
    assert store.count() == 0  # never part of the log


def test_snapshots_latest_and_bounded(store: EventStore) -> None:
    assert store.latest_snapshot("p/tp0") is None
    for seq in (10, 20, 30):
        store.save_snapshot(StoredSnapshot("p/tp0", seq, 1, 1.0, b"state-%d" % seq))
    store.save_snapshot(StoredSnapshot("p/tp0", 20, 1, 2.0, b"again"))
    latest = store.latest_snapshot("p/tp0")
    assert latest is not None and latest.seq == 30 and latest.body == b"state-30"
    bounded = store.latest_snapshot("p/tp0", max_seq=25)
    assert bounded is not None and bounded.body == b"again"
    assert store.latest_snapshot("other") is None


def test_snapshots_below_a_seq_are_deleted_for_their_source_only(store: EventStore) -> None:
    for source, seq in (("p/tp0", 10), ("p/tp0", 20), ("p/tp0", 30), ("", 5)):
        store.save_snapshot(StoredSnapshot(source, seq, 1, 1.0, b"state"))
    assert store.delete_snapshots("p/tp0", 30) == 2
    assert store.latest_snapshot("p/tp0", max_seq=29) is None
    latest = store.latest_snapshot("p/tp0")
    assert latest is not None and latest.seq == 30
    assert store.latest_snapshot("") is not None
    assert store.delete_snapshots("p/tp0", 30) == 0


def test_count_through_a_cursor(store: EventStore) -> None:
    events = _events(5)
    store.append(events)
    cursors = [cursor for cursor, _ in store.tail(0, len(events))]
    assert store.count_through(0) == 0
    assert store.count_through(cursors[2]) == 3
    assert store.count_through(cursors[-1]) == store.count_through(cursors[-1] + 100) == len(events)


def test_the_store_id_is_drawn_once_and_read_the_same_by_every_open(store: EventStore, store_url: str) -> None:
    named = store.store_id()
    assert named and isinstance(named, str)
    store.append(_events(2))
    assert store.store_id() == named  # events change nothing of it
    if store_url == "memory://":
        assert open_store(store_url).store_id() != named  # another memory store is another store
        return
    again = open_store(store_url)
    try:
        assert again.store_id() == named
    finally:
        again.close()


@pytest.mark.nats
def test_a_nats_stream_made_again_under_its_name_is_another_store(nats_url: str) -> None:
    first = open_store(nats_url, create=True)
    named = first.store_id()
    assert named.startswith(nats_url.rsplit("/", 1)[1].split("?")[0] + "@")
    first.delete_stream()  # type: ignore[attr-defined]
    first.close()
    again = open_store(nats_url, create=True)
    try:
        assert again.store_id() != named
    finally:
        again.close()


def test_closed_store_raises(store: EventStore) -> None:
    store.close()
    with pytest.raises(StoreError, match="closed"):
        store.count()
