"""The service starts from its newest usable snapshot and folds only what follows: the same state, audit
findings and releases as a fold of the whole store, on SQLite and PostgreSQL; snapshots it cannot use
(corrupt, another format, rows committed below their cursor since, the newest rows removed and their cursors
taken again, another store's) are passed over with a warning."""

from __future__ import annotations

import gc
import logging
import random
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import delete, insert

from kvledger.api import limits, snapshots
from kvledger.api.app import create_app
from kvledger.api.live import Live, Written
from kvledger.ledger.audit import Finding, audit
from kvledger.ledger.events import Event
from kvledger.ledger.store import snapshot
from kvledger.ledger.store.base import StoredSnapshot
from kvledger.ledger.store.connect import open_store
from kvledger.ledger.store.rows import INSERT_COLUMNS, encode_rows
from kvledger.ledger.store.schema import events as events_table
from kvledger.ledger.store.sql import SqlStore
from tests.api.conftest import settings_for, wait_for
from tests.ledger.builders import Side
from tests.ledger.histories import Shape, audit_moments, history

SEEDS = (1, 2, 3, 4)


@contextmanager
def _service(url: str, **overrides: Any) -> Iterator[Live]:
    """A started service over `url` (writing no snapshot unless asked): its live fold."""
    app = create_app(settings_for(url, **{"snapshot_every_events": 0, **overrides}))
    with TestClient(app):
        live: Live = app.state.live
        yield live


def _snapshot_now(url: str) -> int:
    """Start a service that writes its snapshot in the background; the snapshot's cursor."""
    with _service(url, snapshot_every_events=1) as live:
        wait_for(lambda: live.snapshot_written is not None)
        assert live.snapshot_written is not None
        return live.snapshot_written.cursor


def _append(url: str, events: list[Event]) -> None:
    store = open_store(url)
    try:
        store.append(events)
    finally:
        store.close()


def _folded(live: Live, moments: list[float]) -> tuple[bytes, list[list[Finding]]]:
    """Everything the fold built (state, releases, counts, orders, as the snapshot encodes them) and the
    audit's findings at each of `moments`."""
    _, _, body = snapshots.encode(live)
    return body, [audit(live.state, now, live.audit_config) for now in moments]


def _refolded(url: str, moments: list[float]) -> tuple[bytes, list[list[Finding]]]:
    with _service(url, snapshots_read=False) as live:
        assert live.restored_from is None
        return _folded(live, moments)


@pytest.mark.parametrize("seed", SEEDS)
def test_a_start_from_a_snapshot_equals_a_fold_from_zero(store_url: str, seed: int) -> None:
    events = history(seed, Shape(transfers=12))
    rng = random.Random(seed)
    split = rng.randrange(1, len(events))
    _append(store_url, events[:split])
    cursor = _snapshot_now(store_url)
    _append(store_url, events[split:])
    moments = audit_moments(events, rng)
    with _service(store_url) as live:
        assert live.restored_from == cursor
        assert live.rows_folded == len(events)
        started = _folded(live, moments)
    assert started == _refolded(store_url, moments)
    assert sum(map(len, started[1])) > 0  # the histories' faults leave findings to compare


def test_the_request_index_a_snapshot_derives_from_the_sides_is_the_one_the_fold_built(sqlite_url: str) -> None:
    """The snapshot writes only where `by_request` differs from what the sides' maps say: a refused map's
    request, a request whose sides were mapped in another order than first seen; the rest is derived."""
    p = Side("prefill-0/tp0")
    events = [
        p.ack("b", "read"),  # side b is seen first, unmapped
        p.map("a", "r-1", blocks=(1,)),
        p.map("b", "r-1", blocks=(2,)),  # mapped after a: r-1's sides are (a, b), the sides' order (b, a)
        p.map("a", "r-2", blocks=(3,)),  # refused (the id is taken): r-2 names side a, its map says r-1
        p.map("c", "r-3", blocks=(4,)),
    ]
    _append(sqlite_url, events)
    _snapshot_now(sqlite_url)
    with _service(sqlite_url) as live:
        assert live.restored_from is not None
        _, _, body = snapshots.encode(live)
        doc = snapshots._decoder.decode(snapshots.unsealed(body))
        assert doc.order is None and doc.requests_gone == []
        a, b = (p.source, "a"), (p.source, "b")
        assert doc.requests_apart == [("r-1", (a, b)), ("r-2", (a,))]
        restored = (live.order, live.by_request)
    with _service(sqlite_url, snapshots_read=False) as live:
        assert restored == (live.order, live.by_request)
        assert live.by_request == {"r-1": (a, b), "r-2": (a,), "r-3": ((p.source, "c"),)}


def test_a_snapshot_is_the_fold_it_was_copied_from_however_far_the_fold_went_while_it_was_encoded(
    sqlite_url: str,
) -> None:
    events = history(3, Shape(transfers=12))
    half = len(events) // 2
    _append(sqlite_url, events[:half])
    with _service(sqlite_url) as live:
        _, _, expected = snapshots.encode(live)
        taken = snapshots._take(live)  # what `write` copies under the fold lock, then encodes without it
        _append(sqlite_url, events[half:])
        wait_for(lambda: live.rows_folded == len(events))  # the poller folded the rest meanwhile
        assert snapshots.encode(live)[2] != expected
        assert snapshots.seal(snapshots._encoded(taken)) == expected


def _save(url: str, cursor: int, body: bytes, format_: int = snapshots.FORMAT) -> None:
    store = open_store(url)
    try:
        store.save_snapshot(StoredSnapshot(snapshots.SOURCE, cursor, format_, time.time(), body))
    finally:
        store.close()


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == snapshots.__name__]


def _refolded_at_start(
    url: str, rows: int, at: float, caplog: pytest.LogCaptureFixture
) -> tuple[tuple[bytes, list[list[Finding]]], str]:
    """A service started over `url` whose snapshot is refused: it restores none and folds all `rows`. Returns
    what it then says at `at` and the one warning it logged."""
    caplog.set_level(logging.WARNING, logger=snapshots.__name__)
    with _service(url) as live:
        assert live.restored_from is None
        assert live.rows_folded == rows
        started = _folded(live, [at])
    (warning,) = _warnings(caplog)
    return started, warning


def _checksummed(document: bytes) -> bytes:
    """`document` sealed as format 2 sealed it: its CRC-32 after it, not compressed."""
    return document + zlib.crc32(document).to_bytes(4, "little")


def _flipped(body: bytes) -> bytes:
    """`body` with one byte in its middle changed, as a damaged page would change it."""
    middle = len(body) // 2
    return body[:middle] + bytes([body[middle] ^ 0x10]) + body[middle + 1 :]


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        (_flipped, "checksum does not match"),
        (lambda _: snapshots.seal(b"\x93 not a snapshot"), "not a snapshot"),
        (lambda _: _checksummed(b"\x81\xa6format\x02"), "does not decompress"),  # sealed uncompressed
        (lambda _: snapshots.seal(msgspec.msgpack.encode({"format": snapshots.FORMAT})), "body does not decode"),
        (lambda body: _with_ledger_format(body, snapshot.FORMAT), "snapshot does not decode"),
    ],
)
def test_a_corrupt_snapshot_is_passed_over_for_the_older_one(
    sqlite_url: str, caplog: pytest.LogCaptureFixture, damage: Callable[[bytes], bytes], why: str
) -> None:
    events = history(5, Shape(transfers=10))
    _append(sqlite_url, events[: len(events) // 2])
    older = _snapshot_now(sqlite_url)
    _append(sqlite_url, events[len(events) // 2 :])
    newer = _snapshot_now(sqlite_url)
    store = open_store(sqlite_url)
    try:
        written = store.latest_snapshot(snapshots.SOURCE)
        assert written is not None and written.seq == newer
    finally:
        store.close()
    _save(sqlite_url, newer, damage(written.body))
    caplog.set_level(logging.WARNING, logger=snapshots.__name__)
    with _service(sqlite_url) as live:
        assert live.restored_from == older
        assert live.rows_folded == len(events)
        started = _folded(live, [events[-1].ts])
    (warning,) = _warnings(caplog)
    assert f"snapshot at cursor {newer} " in warning and why in warning
    assert started == _refolded(sqlite_url, [events[-1].ts])


def _with_ledger_format(body: bytes, ledger_format: int) -> bytes:
    """`body` with its ledger part replaced by a document of another ledger snapshot format."""
    doc = msgspec.msgpack.decode(snapshots.unsealed(body))
    doc["ledger"] = {"format": ledger_format}  # nested in the service's document, as written
    return snapshots.seal(msgspec.msgpack.encode(doc))


@pytest.mark.parametrize(
    ("column_format", "ledger_format", "why"),
    [
        (snapshots.FORMAT - 1, snapshot.FORMAT, f"format {snapshots.FORMAT - 1}, this code reads {snapshots.FORMAT}"),
        (snapshots.FORMAT, snapshot.FORMAT - 1, f"format {snapshot.FORMAT - 1}, this code reads {snapshot.FORMAT}"),
    ],
)
def test_an_old_format_snapshot_is_ignored_and_the_fold_starts_from_zero(
    sqlite_url: str, caplog: pytest.LogCaptureFixture, column_format: int, ledger_format: int, why: str
) -> None:
    events = history(6, Shape(transfers=10))
    _append(sqlite_url, events)
    cursor = _snapshot_now(sqlite_url)
    store = open_store(sqlite_url)
    try:
        written = store.latest_snapshot(snapshots.SOURCE)
        assert written is not None and written.seq == cursor
        store.delete_snapshots(snapshots.SOURCE, cursor + 1)
    finally:
        store.close()
    _save(sqlite_url, cursor, _with_ledger_format(written.body, ledger_format), column_format)
    started, warning = _refolded_at_start(sqlite_url, len(events), events[-1].ts, caplog)
    assert f"snapshot at cursor {cursor} " in warning and why in warning
    assert started == _refolded(sqlite_url, [events[-1].ts])


def _insert_at(url: str, rows: list[tuple[int, Event]]) -> None:
    """Store events at chosen cursors, as concurrent writers whose commits land out of cursor order would."""
    store = open_store(url)
    assert isinstance(store, SqlStore)
    try:
        with store.engine.begin() as conn:
            values = [
                {"cursor": cursor, **dict(zip(INSERT_COLUMNS, row, strict=True))}
                for (cursor, _), row in zip(rows, encode_rows(e for _, e in rows), strict=True)
            ]
            conn.execute(insert(events_table), values)
    finally:
        store.close()


def test_a_row_committed_below_the_snapshot_is_folded_not_skipped(
    store_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    events = history(7, Shape(transfers=10))
    split = len(events) // 2
    late = split - 3
    # Cursor `late + 1` is left free: a writer that took it commits only after the snapshot.
    _insert_at(store_url, [(i + 1 if i < late else i + 2, e) for i, e in enumerate(events[:split]) if i != late])
    cursor = _snapshot_now(store_url)
    assert cursor == split + 1
    _insert_at(store_url, [(late + 1, events[late])])
    _insert_at(store_url, [(i + 2, e) for i, e in enumerate(events) if i >= split])
    started, warning = _refolded_at_start(store_url, len(events), events[-1].ts, caplog)
    assert f"snapshot at cursor {cursor} " in warning and "committed below its cursor" in warning
    assert started == _refolded(store_url, [events[-1].ts])


def _delete_from(url: str, cursor: int) -> None:
    """Remove the events at `cursor` and after, as an operator trimming the newest rows by hand would."""
    store = open_store(url)
    assert isinstance(store, SqlStore)
    try:
        with store.engine.begin() as conn:
            conn.execute(delete(events_table).where(events_table.c.cursor >= cursor))
    finally:
        store.close()


def test_a_snapshot_whose_newest_events_were_removed_and_their_cursors_taken_again_is_refused(
    store_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """SQLite gives a new row the highest rowid plus one: rows appended after the newest were deleted take the
    deleted ones' cursors, so the count up to the snapshot's cursor is what it was and only the event at it
    tells. Believed, the snapshot would skip the new rows and keep the deleted ones' effects. (PostgreSQL's
    sequence never gives a cursor twice: there the count tells.)"""
    events = history(9, Shape(transfers=12))
    split = len(events) // 2
    _append(store_url, events[:split])
    cursor = _snapshot_now(store_url)
    assert cursor == split
    _delete_from(store_url, cursor - 1)  # the newest two events go
    _append(store_url, events[split:])
    store = open_store(store_url)
    try:
        reused = store.tail(cursor - 1, 1)[0]
    finally:
        store.close()
    sqlite = store_url.startswith("sqlite")
    assert reused == ((cursor, events[split + 1]) if sqlite else (cursor + 1, events[split]))
    started, warning = _refolded_at_start(store_url, len(events) - 2, events[-1].ts, caplog)
    assert f"snapshot at cursor {cursor} " in warning
    if sqlite:
        event = events[split + 1]
        assert f"event at its cursor {cursor} is {event.source!r} seq {event.seq}" in warning
        assert "others stored at their cursors" in warning
    else:
        assert "or removed" in warning
    assert started == _refolded(store_url, [events[-1].ts])
    assert sum(map(len, started[1])) > 0


def test_a_snapshot_copied_from_another_store_is_refused(
    store_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Another store holding the same events: the counts and the event at the cursor agree, only the store's
    id tells the snapshot is not this store's."""
    events = history(10, Shape(transfers=12))
    other = f"sqlite:///{tmp_path / 'other.db'}"
    open_store(other, create=True).close()
    for url in (other, store_url):
        _append(url, events)
    cursor = _snapshot_now(other)
    source = open_store(other)
    try:
        copied = source.latest_snapshot(snapshots.SOURCE)
        other_id = source.store_id()
    finally:
        source.close()
    assert copied is not None and copied.seq == cursor
    target = open_store(store_url)
    try:
        target.save_snapshot(copied)
        own_id = target.store_id()
    finally:
        target.close()
    assert own_id != other_id
    started, warning = _refolded_at_start(store_url, len(events), events[-1].ts, caplog)
    assert f"snapshot at cursor {cursor} " in warning
    assert f"taken of another store (store id {other_id!r}; this store's is {own_id!r})" in warning
    assert started == _refolded(store_url, [events[-1].ts])


def test_the_background_writer_keeps_the_newest_two(sqlite_url: str) -> None:
    events = history(8, Shape(transfers=10))
    thirds = [
        events[: len(events) // 3],
        events[len(events) // 3 : 2 * len(events) // 3],
        events[2 * len(events) // 3 :],
    ]
    cursors = []
    for part in thirds:
        _append(sqlite_url, part)
        cursors.append(_snapshot_now(sqlite_url))
    store = open_store(sqlite_url)
    try:
        kept = [store.latest_snapshot(snapshots.SOURCE), store.latest_snapshot(snapshots.SOURCE, cursors[2] - 1)]
        assert [s.seq if s is not None else None for s in kept] == cursors[2:0:-1]
        assert store.latest_snapshot(snapshots.SOURCE, cursors[1] - 1) is None
    finally:
        store.close()


@pytest.mark.parametrize("sides_min", [1, 10_000_000])
def test_a_restored_fold_is_frozen_out_of_the_collector_only_when_large_and_a_stop_leaves_nothing_frozen(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch, sides_min: int
) -> None:
    """The decoding's objects go straight to the collector's permanent generation when the service would
    freeze them at its start anyway (kvledger.api.limits), and the service's stop lets go of them again."""
    events = history(7, Shape(transfers=10))
    _append(sqlite_url, events)
    _snapshot_now(sqlite_url)
    monkeypatch.setattr(limits, "GC_FREEZE_SIDES_MIN", sides_min)
    frozen_before = gc.get_freeze_count()
    store = open_store(sqlite_url)
    try:
        restored = snapshots.load_newest(store)
        assert restored is not None and len(restored.state.transfers) >= 1
        assert (gc.get_freeze_count() > frozen_before) is (sides_min == 1)
    finally:
        gc.unfreeze()  # what the service's stop does; the test's process then frees as before
        store.close()
    with _service(sqlite_url) as live:
        assert live.restored_from is not None
    assert gc.get_freeze_count() == 0


def test_a_snapshot_is_due_by_events_or_interval_but_never_sooner_than_ten_times_what_the_last_cost() -> None:
    live = Live(settings_for("sqlite://", snapshot_every_events=100, snapshot_interval_s=600))
    live.rows_folded = 150
    assert snapshots.due(live, 0.0)  # none written yet: by events alone
    live.snapshot_written, live.snapshot_rows = Written(50, 50, 1, 0.1, 2.0, 0.1), 50
    assert not snapshots.due(live, 19.9)  # 100 new events, but the last cost 2 CPU seconds
    assert snapshots.due(live, limits.SNAPSHOT_COST_FACTOR * 2.0)
    live.rows_folded = 149
    assert not snapshots.due(live, 599.0)  # 99 new: not by events, not yet by interval
    assert snapshots.due(live, 600.0)
    live.rows_folded = 50
    assert not snapshots.due(live, 10_000.0)  # nothing new
