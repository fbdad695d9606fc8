"""The background writer: batches, order, spill when the store is down, exactly-once reload, counts."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import msgspec
import pytest

from kvledger.ledger.events import Event, from_json
from kvledger.ledger.jsonl import read_events
from kvledger.ledger.log import EventLog
from kvledger.ledger.store.base import EventStore, StoreError, StoreUnavailable
from kvledger.ledger.store.connect import open_store
from kvledger.ledger.store.writer import BackgroundWriter
from kvledger.ledger.synth import SynthConfig, generate


class FlakyStore:
    """A real store behind a switch: while `down`, every append fails as an unreachable store would."""

    def __init__(self, inner: EventStore) -> None:
        self.inner = inner
        self.url = inner.url
        self.down = False
        self.batches: list[int] = []

    def append(self, events: Sequence[Event]) -> int:
        if self.down:
            raise StoreUnavailable(f"{self.url}: down for the test")
        self.batches.append(len(events))
        return self.inner.append(events)

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


def _events(transfers: int) -> list[Event]:
    # Unassigned seqs: the logs number them, as in the connector.
    return list(generate(SynthConfig(transfers=transfers, seq_assigned=False), seed=3))


def _append_all(events: list[Event], writer: BackgroundWriter) -> list[Event]:
    logs: dict[str, EventLog] = {}
    appended = []
    for event in events:
        log = logs.get(event.source)
        if log is None:
            log = logs[event.source] = EventLog(event.source)
            log.subscribe(writer.put)
        appended.append(log.append(event))
    return appended


@pytest.fixture
def sqlite_store(tmp_path: Path) -> Iterator[EventStore]:
    store = open_store(str(tmp_path / "ledger.db"), create=True)
    yield store
    store.close()


def test_everything_written_in_order_in_bounded_batches(sqlite_store: EventStore, tmp_path: Path) -> None:
    flaky = FlakyStore(sqlite_store)
    writer = BackgroundWriter(flaky, tmp_path / "spill", batch_events_max=100).start()
    appended = _append_all(_events(300), writer)
    assert writer.close(timeout=30)
    assert list(sqlite_store.read()) == appended
    assert max(flaky.batches) <= 100
    stats = writer.stats()
    assert stats["written"] == stats["queued"] == len(appended)
    assert stats["spilled"] == stats["failed_attempts"] == stats["dropped"] == 0


def test_store_down_spills_and_reloads_exactly_once_in_order(sqlite_store: EventStore, tmp_path: Path) -> None:
    flaky = FlakyStore(sqlite_store)
    writer = BackgroundWriter(flaky, tmp_path / "spill", queue_events_max=50, batch_events_max=20).start()
    events = _events(200)
    flaky.down = True
    first = _append_all(events[:600], writer)  # far more than the queue holds
    stats = writer.stats()
    assert stats["spilled"] > 0 and stats["spill_files_pending"] > 0
    assert stats["queued"] + stats["spilled"] == 600
    assert sqlite_store.count() == 0
    # Let the writer meet the outage at least once before the store comes back: on a
    # loaded machine its thread may not have run yet.
    give_up = time.monotonic() + 30
    while writer.stats()["failed_attempts"] == 0 and time.monotonic() < give_up:
        time.sleep(0.01)
    flaky.down = False
    assert writer.flush(timeout=30)
    assert list(sqlite_store.read()) == first
    stats = writer.stats()
    assert stats["failed_attempts"] > 0
    # The queue and the batch in flight went to the spill file first, ahead of the events after them.
    assert stats["respilled"] > 0 and stats["dropped"] == 0, stats
    assert stats["written"] == 600 and stats["loaded_from_spill"] == stats["spilled"] + stats["respilled"]
    assert not list((tmp_path / "spill").glob("spill-*.jsonl"))
    assert writer.close(timeout=30)


def test_close_while_down_keeps_everything_for_the_next_writer(sqlite_store: EventStore, tmp_path: Path) -> None:
    flaky = FlakyStore(sqlite_store)
    spill = tmp_path / "spill"
    writer = BackgroundWriter(flaky, spill, queue_events_max=40, batch_events_max=10).start()
    flaky.down = True
    appended = _append_all(_events(30), writer)
    assert writer.close(timeout=0.3) is False  # could not flush: says so
    stats = writer.stats()
    assert stats["dropped"] == 0 and stats["spilled"] + stats["respilled"] >= len(appended) - stats["written"]
    kept = [e for f in sorted(spill.glob("spill-*.jsonl")) for e in read_events(f)]
    assert kept == appended  # in order, on disk
    flaky.down = False
    again = BackgroundWriter(flaky, spill).start()  # the next process's writer
    assert again.close(timeout=30)
    assert list(sqlite_store.read()) == appended
    assert again.stats()["loaded_from_spill"] == len(appended)


def test_conflicting_event_is_quarantined_and_counted(sqlite_store: EventStore, tmp_path: Path) -> None:
    events = list(generate(SynthConfig(transfers=5), seed=1))
    sqlite_store.append(events[:3])
    clash = msgspec.structs.replace(events[1], ts=0.5)
    writer = BackgroundWriter(sqlite_store, tmp_path / "spill").start()
    for event in [events[0], clash, *events[2:]]:
        writer.put(event)
    assert writer.close(timeout=30)
    stats = writer.stats()
    assert stats["quarantined"] == 1 and "different content" in str(stats["last_error"])
    [kept] = sqlite_store.quarantined()
    assert from_json(kept.body) == clash and "ConflictError" in kept.reason
    assert list(sqlite_store.read()) == events


def test_an_event_the_store_cannot_take_is_quarantined_and_the_writer_goes_on(
    sqlite_store: EventStore, tmp_path: Path
) -> None:
    """Once, an integer past 64 bits or a source wider than its column stalled the writer for ever."""
    events = list(generate(SynthConfig(transfers=20), seed=1))
    bad = {5: {"seq": 1 << 64}, 9: {"source": "s" * 300}, 10: {"ts": 9e11}}
    stream = [msgspec.structs.replace(e, **bad[i]) if i in bad else e for i, e in enumerate(events)]
    writer = BackgroundWriter(sqlite_store, tmp_path / "spill", batch_events_max=8).start()
    for event in stream:
        writer.put(event)
    assert writer.close(timeout=30)
    stats = writer.stats()
    assert stats["quarantined"] == 3 and stats["written"] == len(events) - 3 and stats["failed_attempts"] == 0
    assert list(sqlite_store.read()) == [e for i, e in enumerate(events) if i not in bad]
    assert [from_json(q.body) for q in sqlite_store.quarantined()] == [stream[i] for i in sorted(bad)]


def test_without_a_quarantine_table_a_refused_event_goes_to_rejected_jsonl(
    sqlite_store: EventStore, tmp_path: Path
) -> None:
    class NoQuarantine(FlakyStore):
        def quarantine(self, items: object) -> int:
            raise StoreError("no such table: quarantine")

    events = list(generate(SynthConfig(transfers=3), seed=1))
    bad = msgspec.structs.replace(events[1], ts=-1.0)
    writer = BackgroundWriter(NoQuarantine(sqlite_store), tmp_path / "spill").start()
    for event in [events[0], bad, *events[2:]]:
        writer.put(event)
    assert writer.close(timeout=30)
    assert writer.stats()["quarantined"] == 1
    assert list(read_events(tmp_path / "spill" / "rejected.jsonl", check=False)) == [bad]
    assert sqlite_store.count() == len(events) - 1


def test_a_quarantine_whose_answer_was_lost_is_counted_once(sqlite_store: EventStore, tmp_path: Path) -> None:
    """The connection cut after the quarantine insert committed: the retry finds the row there and must
    still count it (the outage test saw 0 quarantined with the event in the table)."""

    class LostAnswer(FlakyStore):
        def quarantine(self, items: Sequence[tuple[Event, str]]) -> int:
            kept = self.inner.quarantine(items)
            if kept and not self.batches.count(-1):
                self.batches.append(-1)  # once
                raise StoreUnavailable(f"{self.url}: connection lost before the commit's answer")
            return kept

    events = list(generate(SynthConfig(transfers=3), seed=1))
    bad = msgspec.structs.replace(events[1], ts=-1.0)
    writer = BackgroundWriter(LostAnswer(sqlite_store), tmp_path / "spill").start()
    for event in [events[0], bad, *events[2:]]:
        writer.put(event)
    assert writer.close(timeout=30)
    stats = writer.stats()
    assert stats["quarantined"] == 1 and stats["failed_attempts"] == 1
    assert [from_json(q.body) for q in sqlite_store.quarantined()] == [bad]
    assert list(sqlite_store.read()) == [e for e in events if e is not events[1]]


def test_put_after_close_is_spilled_not_lost(sqlite_store: EventStore, tmp_path: Path) -> None:
    writer = BackgroundWriter(sqlite_store, tmp_path / "spill").start()
    writer.close()
    event = next(generate(SynthConfig(transfers=1)))
    writer.put(event)
    assert writer.stats()["spilled"] == 1
    assert [e for f in (tmp_path / "spill").glob("spill-*.jsonl") for e in read_events(f)] == [event]


def test_an_idle_writer_sleeps_until_a_batch_begins(
    sqlite_store: EventStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer's thread does not poll its queue (in an engine it would take the GIL from vLLM's step every
    few milliseconds): idle, it waits for `put`'s signal that a batch begins; the batch is written once due."""
    steps: list[float] = []
    step = BackgroundWriter._step

    def counted(writer: BackgroundWriter) -> bool:
        steps.append(time.monotonic())
        return step(writer)

    monkeypatch.setattr(BackgroundWriter, "_step", counted)
    writer = BackgroundWriter(sqlite_store, tmp_path / "spill").start()
    time.sleep(0.3)  # idle: a writer polling every 2 ms would have looked about 150 times
    idle_steps = len(steps)
    assert idle_steps <= 3
    events = _append_all(_events(5), writer)
    assert writer.flush(timeout=30)
    assert list(sqlite_store.read()) == events
    assert len(steps) - idle_steps <= 6  # woken, waited out the batch's age, wrote it; no polling meanwhile
    assert writer.close()


def test_a_writer_batches_a_nats_stream_longer_than_a_sql_store_unless_told(
    store: EventStore, store_url: str, tmp_path: Path
) -> None:
    from kvledger.ledger.store.limits import NATS_WRITER_BATCH_AGE_S_MAX, WRITER_BATCH_AGE_S_MAX

    expected = NATS_WRITER_BATCH_AGE_S_MAX if store_url.startswith("nats://") else WRITER_BATCH_AGE_S_MAX
    assert NATS_WRITER_BATCH_AGE_S_MAX > WRITER_BATCH_AGE_S_MAX
    assert BackgroundWriter(store, tmp_path / "a").batch_age_s_max == expected
    assert BackgroundWriter(store, tmp_path / "b", batch_age_s_max=0.01).batch_age_s_max == 0.01
