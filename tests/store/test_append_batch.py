"""`append_returning`, the batched append ingest uses, on every backend: idempotent by (source, seq), all or
nothing on a conflict, and the cursors it reports are the ones the store's tail gives."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import msgspec
import pytest
from sqlalchemy import event

from kvledger.ledger.events import Ack, Event, TransferId
from kvledger.ledger.store.base import ConflictError, EventStore, UnstorableEvent
from kvledger.ledger.store.batch import SOURCES_PER_QUERY
from kvledger.ledger.store.connect import open_store
from kvledger.ledger.store.limits import INSERT_ROWS_PER_STATEMENT
from kvledger.ledger.store.rows import INSERT_COLUMNS, encode_row, encode_rows
from kvledger.ledger.store.sql import SqlStore, rows_per_insert
from kvledger.ledger.synth import SynthConfig, generate
from tests.store.conftest import ROW_BACKENDS, backend_url


@pytest.fixture(params=ROW_BACKENDS)
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Every backend but NATS (tests/store/conftest.py's ROW_BACKENDS says why)."""
    return backend_url(request, tmp_path)


def _events(transfers: int = 40) -> list[Event]:
    return list(generate(SynthConfig(transfers=transfers, concurrency=8), seed=11))


def _highest(events: list[Event]) -> dict[str, int]:
    found: dict[str, int] = {}
    for e in events:
        found[e.source] = max(found.get(e.source, 0), e.seq)
    return found


def test_the_cursors_reported_are_the_tails(store: EventStore) -> None:
    events = _events()
    assert len({e.source for e in events}) > 1  # the one query per batch covers several sources
    first = store.append_returning(events[:50])
    assert first.after_cursor == 0 and first.stored_max == {}
    second = store.append_returning(events[50:])
    assert [e for _, e in first.inserted + second.inserted] == events
    assert first.inserted + second.inserted == store.tail(0, len(events))
    assert second.after_cursor == first.inserted[-1][0]
    assert second.stored_max == {s: m for s, m in _highest(events[:50]).items() if s in _highest(events[50:])}


def test_a_batch_of_several_insert_statements_is_stored_whole_and_in_order(store: EventStore) -> None:
    events = _events(1200)
    count = 2 * INSERT_ROWS_PER_STATEMENT + 7  # two full statements and a short one
    assert len(events) >= 2 * count + 20
    store.append(events[:20])
    appended = store.append_returning(events[: count + 20])  # the first 20 stored already: skipped
    assert [e for _, e in appended.inserted] == events[20 : count + 20]
    assert appended.inserted == store.tail(appended.after_cursor, count + 100)
    assert list(store.read()) == events[: count + 20]
    # A conflict among the last statement's rows leaves the earlier statements' rows unwritten too.
    changed = msgspec.structs.replace(events[5], ts=events[5].ts + 1)
    with pytest.raises(ConflictError):
        store.append([*events[count + 20 : count + 20 + count], changed])
    assert store.count() == count + 20


def test_the_same_batch_twice_inserts_once(store: EventStore) -> None:
    events = _events()
    assert len(store.append_returning(events).inserted) == len(events)
    again = store.append_returning(events)
    assert again.inserted == [] and again.stored_max == _highest(events)
    assert store.count() == len(events) and list(store.read()) == events


def test_stored_identical_events_are_skipped_and_the_new_ones_inserted(store: EventStore) -> None:
    events = _events()
    store.append(events[:30])
    mixed = store.append_returning(events[10:60])
    assert [e for _, e in mixed.inserted] == events[30:60]
    assert mixed.inserted == store.tail(mixed.after_cursor, 100)
    assert list(store.read()) == events[:60]


def test_one_conflicting_event_inserts_nothing_and_is_named(store: EventStore) -> None:
    events = _events()
    store.append(events[:20])
    changed = msgspec.structs.replace(events[7], ts=events[7].ts + 1)
    with pytest.raises(ConflictError) as caught:
        store.append_returning([*events[20:40], changed, *events[40:50]])
    assert f"{changed.source!r} seq {changed.seq}" in str(caught.value)
    assert store.count() == 20


def test_a_repeat_inside_the_batch_is_kept_once_or_refused_when_it_differs(store: EventStore) -> None:
    events = _events(5)
    repeated = store.append_returning([*events, events[2]])
    assert [e for _, e in repeated.inserted] == events
    other = [*_events(3)]
    fresh = [msgspec.structs.replace(e, source="other/tp0") for e in other]
    with pytest.raises(ConflictError, match="other/tp0"):
        store.append_returning([*fresh, msgspec.structs.replace(fresh[0], ts=fresh[0].ts + 1)])
    assert store.count() == len(events)


def test_more_sources_than_one_query_holds(store: EventStore) -> None:
    sources = SOURCES_PER_QUERY + 50
    batch: list[Event] = [
        Ack(seq=1, ts=1.0, source=f"decode-{i}/tp0", transfer_id=TransferId("t"), what="recv") for i in range(sources)
    ]
    assert len(store.append_returning(batch).inserted) == sources
    later = [msgspec.structs.replace(e, seq=3) for e in batch]
    again = store.append_returning([*batch, *later])
    assert [e for _, e in again.inserted] == later
    assert again.stored_max == {e.source: 1 for e in batch}
    with pytest.raises(ConflictError, match=f"decode-{sources - 1}/tp0"):
        store.append_returning([msgspec.structs.replace(batch[-1], ts=2.0)])
    assert store.count() == 2 * sources


def test_a_one_source_batch_is_checked_like_any(store: EventStore) -> None:
    """The shape of an ingest batch (one appender's events): repeats and conflicts are found as in any batch."""
    events = [e for e in _events(30) if e.source == _events(30)[0].source]
    assert len(events) > 10
    first = store.append_returning(events[:5], checked=True)
    assert (first.after_cursor, first.stored_max, len(first.inserted)) == (0, {}, 5)
    again = store.append_returning([*events[3:10], events[7]], checked=True)
    assert [e for _, e in again.inserted] == events[5:10]
    assert again.stored_max == {events[0].source: events[4].seq} and again.after_cursor == 5
    with pytest.raises(ConflictError, match=f"seq {events[11].seq}"):
        store.append_returning([events[10], events[11], msgspec.structs.replace(events[11], ts=1.0)], checked=True)
    assert store.tail(0, 100) == [*first.inserted, *again.inserted]


def test_checked_rows_are_the_rows_each_event_encodes_to() -> None:
    events = _events(200)
    assert len({type(e) for e in events}) > 3
    assert encode_rows(events, checked=True) == [encode_row(e) for e in events]
    assert encode_rows(iter(events), checked=True) == encode_rows(events)


@pytest.mark.postgres
def test_a_value_postgresql_refuses_in_the_copy_is_unstorable(pg_url: str) -> None:
    """The database's own refusal (a source wider than its column, which `checked` let through) is
    translated like any driver error, and nothing of the batch lands."""
    store = open_store(pg_url, create=True)
    try:
        events = _events(3)
        wide = msgspec.structs.replace(events[1], source="s" * 300)
        with pytest.raises(UnstorableEvent, match="refused a value"):
            store.append_returning([events[0], wide], checked=True)
        assert store.count() == 0
        assert len(store.append_returning(events).inserted) == len(events)  # the connection is usable
    finally:
        store.close()


def test_cursors_after_a_gap_in_postgresqls_sequence_are_read_back(pg_url: str) -> None:
    """A refused COPY took sequence values and gave none back: the next batch's cursors do not follow on
    from the highest stored one, and the cursors reported are still the tail's."""
    store = open_store(pg_url, create=True)
    try:
        events = _events(3)
        store.append(events[:2])
        wide = msgspec.structs.replace(events[3], source="s" * 300)
        with pytest.raises(UnstorableEvent):
            store.append_returning([events[2], wide], checked=True)
        appended = store.append_returning(events[2:], checked=True)
        assert appended.inserted == store.tail(appended.after_cursor, 100)
        assert appended.inserted[0][0] > appended.after_cursor + 1  # the gap: read back, not counted on
        assert [e for _, e in appended.inserted] == events[2:]
    finally:
        store.close()


def test_a_connection_allowing_fewer_parameters_gets_smaller_statements(tmp_path: Path) -> None:
    """SQLite before 3.32 allowed 999 parameters a statement: a batch is then split to fit, stored whole."""
    store = open_store(f"sqlite:///{tmp_path}/old.db", create=True)
    assert isinstance(store, SqlStore)

    @event.listens_for(store.engine, "connect")
    def _old_limit(driver: sqlite3.Connection, _record: object) -> None:
        driver.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, 999)

    store.engine.dispose()  # connections made from now on have the old limit
    with store.engine.connect() as conn:
        assert rows_per_insert(conn.connection.driver_connection) == 999 // len(INSERT_COLUMNS)
    events = _events(200)
    assert len(events) > INSERT_ROWS_PER_STATEMENT
    appended = store.append_returning(events[:INSERT_ROWS_PER_STATEMENT])
    assert [e for _, e in appended.inserted] == events[:INSERT_ROWS_PER_STATEMENT]
    assert list(store.read()) == events[:INSERT_ROWS_PER_STATEMENT]
    store.close()
