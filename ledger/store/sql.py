"""The SQL store (SQLite and PostgreSQL, one code path) on SQLAlchemy Core.

The write path hands pre-encoded tuples to the driver inside a SQLAlchemy
transaction (multi-row INSERTs on SQLite, PostgreSQL's binary COPY): on SQLite that is
most of raw sqlite3's speed, where building Core parameter dicts would cost a
third of it (benchmarks/store.py). Which rows are stored already, each source's
highest seq and the highest cursor are one query per batch (ledger/store/batch.py),
and `append_returning` reports the cursors the new rows got, so a service folds what
it ingested without reading it back.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator, Sequence
from functools import lru_cache
from itertools import chain
from typing import Any

from sqlalchemy import Connection, Engine, Select, delete, exc, func, insert, select

from kvledger.ledger.events import Event, TransferId, from_msgpack
from kvledger.ledger.store.base import Appended, Quarantined, StoredSnapshot, StoreError
from kvledger.ledger.store.batch import CURSOR, STORED, batch_keys, chunks, fresh_indices, lookup_params, lookup_sql
from kvledger.ledger.store.errors import translate
from kvledger.ledger.store.limits import (
    INSERT_ROWS_PER_STATEMENT,
    QUARANTINE_READ_MAX,
    READ_CHUNK_ROWS,
    TAIL_EVENTS_MAX,
)
from kvledger.ledger.store.rows import INSERT_COLUMNS, QUARANTINE_COLUMNS, Row, encode_rows, quarantine_row
from kvledger.ledger.store.schema import events, identity, quarantine, snapshots
from kvledger.ledger.store.url import StoreUrl

_PLACEHOLDER = {"qmark": "?", "format": "%s", "pyformat": "%s"}
_COPY_TYPES = ("text", "int8", "float8", "text", "text", "bytea")
"""PostgreSQL's binary types for the columns of INSERT_COLUMNS."""


@lru_cache(maxsize=8)
def _insert_sql(rows: int, mark: str) -> str:
    """An INSERT of `rows` rows of INSERT_COLUMNS in one VALUES list."""
    one = f"({', '.join([mark] * len(INSERT_COLUMNS))})"
    return f"INSERT INTO events ({', '.join(INSERT_COLUMNS)}) VALUES {', '.join([one] * rows)}"


def rows_per_insert(driver: Any) -> int:
    """Rows per SQLite INSERT statement on `driver` (a sqlite3 connection): INSERT_ROWS_PER_STATEMENT, or as
    many as its limit on a statement's parameters allows (999 before SQLite 3.32)."""
    variables = int(driver.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER))
    return max(1, min(INSERT_ROWS_PER_STATEMENT, variables // len(INSERT_COLUMNS)))


class SqlStore:
    """An EventStore over a SQLAlchemy engine whose schema version `open_store` has checked."""

    def __init__(self, engine: Engine, store_url: StoreUrl) -> None:
        self.url = store_url.display
        self.engine = engine
        self._postgres = store_url.is_postgres
        self._mark = _PLACEHOLDER[engine.dialect.paramstyle]
        self._copy_sql = f"COPY events ({', '.join(INSERT_COLUMNS)}) FROM STDIN (FORMAT BINARY)"
        self._closed = False
        self._id: str | None = None

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"{self.url}: store is closed")

    def store_id(self) -> str:
        self._check_open()
        if self._id is None:  # read once: the row is never written again
            try:
                with self.engine.connect() as conn:
                    found = [row[0] for row in conn.execute(select(identity.c.store_id).limit(2))]
            except Exception as error:
                raise translate(error, self.url) from error
            if len(found) != 1:
                raise StoreError(
                    f"{self.url}: its table {identity.name} holds {len(found) or 'no'} store ids where kvledger "
                    "writes one (edited by hand?): its snapshots cannot be checked against it"
                )
            self._id = str(found[0])
        return self._id

    # -- writes ------------------------------------------------------------

    def append(self, events_: Sequence[Event]) -> int:
        self._check_open()
        if not events_:
            return 0
        return len(self._append(encode_rows(events_), report=False)[0])

    def append_returning(self, events_: Sequence[Event], *, checked: bool = False) -> Appended:
        self._check_open()
        if not events_:
            return Appended([], 0, {})
        rows = encode_rows(events_, checked=checked)
        fresh, cursors, after_cursor, stored_max = self._append(rows, report=True)
        inserted = events_ if len(fresh) == len(events_) else map(events_.__getitem__, fresh)
        return Appended(list(zip(cursors, inserted, strict=True)), after_cursor, stored_max)

    def _append(self, rows: list[Row], *, report: bool) -> tuple[list[int], list[int], int, dict[str, int]]:
        """Insert the rows not stored yet, in one transaction: (their positions in `rows`, and with
        `report` their cursors, the highest cursor before them and each source's highest seq before)."""
        cursors: list[int] = []
        try:
            with self.engine.connect() as conn:
                conn = conn.execution_options(kvledger_write=True)  # BEGIN IMMEDIATE on SQLite
                with conn.begin():
                    if self._postgres:
                        # One writer at a time, so cursors commit in order and a tail reader never
                        # skips a row that commits late (eventsourcing's approach). Readers go on.
                        conn.exec_driver_sql("LOCK TABLE events IN EXCLUSIVE MODE")
                    ranges, unique = batch_keys(rows)
                    stored, stored_max, after_cursor = self._lookup(conn, ranges)
                    fresh = fresh_indices(rows, stored, unique, self.url)
                    if fresh:
                        last = self._insert(conn, rows if len(fresh) == len(rows) else [rows[i] for i in fresh])
                        if report:
                            cursors = self._cursors_after(conn, after_cursor, len(fresh), last)
                    return fresh, cursors, after_cursor, stored_max
        except Exception as error:
            raise translate(error, self.url) from error

    def _insert(self, conn: Connection, rows: list[Row]) -> int | None:
        """Insert `rows`; the cursor the last one got where the driver says (SQLite), else None."""
        if not self._postgres:
            # Many rows per INSERT statement: sqlite3's executemany binds, steps and resets its statement once
            # per row; 1,000 rows took about 4 ms that way and 2.5 ms in statements of 100.
            chunk, last = rows_per_insert(conn.connection.driver_connection), None
            for first in range(0, len(rows), chunk):
                some = rows[first : first + chunk]
                result = conn.exec_driver_sql(_insert_sql(len(some), self._mark), tuple(chain.from_iterable(some)))
                last = result.lastrowid  # sqlite3_last_insert_rowid: the last row of a multi-row INSERT
            return last
        # Binary COPY on PostgreSQL: one stream instead of a round of parse and bind per row, at about
        # twice executemany's rate and a tenth of its client time (benchmarks/api.py).
        import psycopg

        driver = conn.connection.driver_connection
        assert driver is not None, "a connection inside a transaction"
        try:
            with driver.cursor() as cursor, cursor.copy(self._copy_sql) as copy:
                copy.set_types(_COPY_TYPES)
                for row in rows:
                    copy.write_row(row)
        except psycopg.Error as error:
            # The driver's own error, as SQLAlchemy would have wrapped it, for `translate`.
            raise exc.DBAPIError.instance(self._copy_sql, None, error, psycopg.Error) from error
        return None

    def _lookup(
        self, conn: Connection, ranges: dict[str, tuple[int, int]]
    ) -> tuple[dict[tuple[str, int], bytes], dict[str, int], int]:
        """In one statement per chunk of sources: the body of every stored row whose seq lies in its source's
        range of the batch, each source's highest stored seq (if it has any), and the highest cursor."""
        stored: dict[tuple[str, int], bytes] = {}
        highest: dict[str, int] = {}
        cursor = 0
        for chunk in chunks(ranges):
            found = conn.exec_driver_sql(lookup_sql(len(chunk), self._mark), lookup_params(chunk))
            for tag, source, seq, body in found:
                if tag == STORED:
                    stored[(source, seq)] = bytes(body)
                elif tag == CURSOR:
                    cursor = int(seq or 0)
                elif seq is not None:
                    highest[source] = int(seq)
        return stored, highest, cursor

    def _max_cursor(self, conn: Connection) -> int:
        return int(conn.exec_driver_sql("SELECT max(cursor) FROM events").scalar() or 0)

    def _cursors_after(self, conn: Connection, after_cursor: int, inserted: int, last: int | None) -> list[int]:
        """The cursors the rows just inserted got, in insertion order. Under the write lock no other
        writer inserts, so they are the rows after `after_cursor`: almost always consecutive (SQLite's
        rowid, PostgreSQL's sequence), read back only when they are not. `last`: the last row's cursor
        as the driver reported it (SQLite), else it is read."""
        if last is None:
            last = self._max_cursor(conn)
        if last == after_cursor + inserted:
            return list(range(after_cursor + 1, last + 1))
        query = f"SELECT cursor FROM events WHERE cursor > {self._mark} ORDER BY cursor"
        return [int(c) for (c,) in conn.exec_driver_sql(query, (after_cursor,))]

    def save_snapshot(self, snapshot: StoredSnapshot) -> None:
        self._check_open()
        try:
            with self.engine.begin() as conn:
                conn.execute(
                    delete(snapshots).where(snapshots.c.source == snapshot.source, snapshots.c.seq == snapshot.seq)
                )
                conn.execute(insert(snapshots).values(**snapshot._asdict()))
        except Exception as error:
            raise translate(error, self.url) from error

    def quarantine(self, items: Sequence[tuple[Event, str]]) -> int:
        self._check_open()
        if not items:
            return 0
        rows = [dict(zip(QUARANTINE_COLUMNS, quarantine_row(event, reason), strict=True)) for event, reason in items]
        try:
            with self.engine.connect() as conn:
                conn = conn.execution_options(kvledger_write=True)
                with conn.begin():
                    # Idempotent like append: the same event quarantined again (a spilled copy of a batch
                    # that was in flight) is kept once.
                    fresh = []
                    for row in rows:
                        query = select(quarantine.c.id).where(
                            quarantine.c.source == row["source"], quarantine.c.body == row["body"]
                        )
                        if conn.execute(query.limit(1)).first() is None and row not in fresh:
                            fresh.append(row)
                    if fresh:
                        conn.execute(insert(quarantine), fresh)
                    return len(fresh)
        except Exception as error:
            raise translate(error, self.url) from error

    # -- reads ------------------------------------------------------------

    def read(
        self,
        *,
        source: str | None = None,
        after_seq: int = 0,
        until_seq: int | None = None,
        transfer_id: TransferId | None = None,
        ts_from: float | None = None,
        ts_to: float | None = None,
        limit: int | None = None,
    ) -> Iterator[Event]:
        """Stream matching events in cursor order; `ts_from` and `ts_to` are both inclusive."""
        self._check_open()
        query: Select[Any] = select(events.c.body).order_by(events.c.cursor)
        if source is not None:
            query = query.where(events.c.source == source)
        if after_seq > 0:
            query = query.where(events.c.seq > after_seq)
        if until_seq is not None:
            query = query.where(events.c.seq <= until_seq)
        if transfer_id is not None:
            query = query.where(events.c.transfer_id == transfer_id)
        if ts_from is not None:
            query = query.where(events.c.ts >= ts_from)
        if ts_to is not None:
            query = query.where(events.c.ts <= ts_to)
        if limit is not None:
            query = query.limit(limit)
        return self._stream(query)

    def _stream(self, query: Select[Any]) -> Iterator[Event]:
        try:
            with self.engine.connect() as conn:
                # A server-side cursor on PostgreSQL; chunked fetches on SQLite. Memory stays bounded.
                result = conn.execution_options(stream_results=True, yield_per=READ_CHUNK_ROWS).execute(query)
                for (body,) in result:
                    yield from_msgpack(body)
        except GeneratorExit:
            raise
        except Exception as error:
            raise translate(error, self.url) from error

    def tail(self, after_cursor: int = 0, limit: int = 1000) -> list[tuple[int, Event]]:
        self._check_open()
        query = (
            select(events.c.cursor, events.c.body)
            .where(events.c.cursor > after_cursor)
            .order_by(events.c.cursor)
            .limit(min(limit, TAIL_EVENTS_MAX))
        )
        try:
            with self.engine.connect() as conn:
                return [(cursor, from_msgpack(body)) for cursor, body in conn.execute(query)]
        except Exception as error:
            raise translate(error, self.url) from error

    def sources(self) -> dict[str, int]:
        self._check_open()
        query = select(events.c.source, func.max(events.c.seq)).group_by(events.c.source)
        try:
            with self.engine.connect() as conn:
                return {source: int(seq) for source, seq in conn.execute(query)}
        except Exception as error:
            raise translate(error, self.url) from error

    def count(self) -> int:
        self._check_open()
        try:
            with self.engine.connect() as conn:
                return int(conn.execute(select(func.count()).select_from(events)).scalar_one())
        except Exception as error:
            raise translate(error, self.url) from error

    def count_through(self, cursor: int) -> int:
        self._check_open()
        query = select(func.count()).select_from(events).where(events.c.cursor <= cursor)
        try:
            with self.engine.connect() as conn:
                return int(conn.execute(query).scalar_one())
        except Exception as error:
            raise translate(error, self.url) from error

    def delete_snapshots(self, source: str, below_seq: int) -> int:
        self._check_open()
        query = delete(snapshots).where(snapshots.c.source == source, snapshots.c.seq < below_seq)
        try:
            with self.engine.begin() as conn:
                return int(conn.execute(query).rowcount)
        except Exception as error:
            raise translate(error, self.url) from error

    def latest_snapshot(self, source: str, max_seq: int | None = None) -> StoredSnapshot | None:
        self._check_open()
        query = select(snapshots).where(snapshots.c.source == source).order_by(snapshots.c.seq.desc()).limit(1)
        if max_seq is not None:
            query = query.where(snapshots.c.seq <= max_seq)
        try:
            with self.engine.connect() as conn:
                row = conn.execute(query).first()
        except Exception as error:
            raise translate(error, self.url) from error
        if row is None:
            return None
        return StoredSnapshot(row.source, int(row.seq), int(row.format), float(row.created_ts), bytes(row.body))

    def quarantined(self, *, source: str | None = None, limit: int = QUARANTINE_READ_MAX) -> list[Quarantined]:
        self._check_open()
        query = select(quarantine).order_by(quarantine.c.id.desc()).limit(min(limit, QUARANTINE_READ_MAX))
        if source is not None:
            query = query.where(quarantine.c.source == source)
        try:
            with self.engine.connect() as conn:
                rows = list(conn.execute(query).all())
        except Exception as error:
            raise translate(error, self.url) from error
        rows.reverse()  # the newest `limit`, oldest first
        return [Quarantined(int(r.id), float(r.created_ts), r.source, r.seq, r.reason, bytes(r.body)) for r in rows]

    def quarantined_count(self) -> int:
        self._check_open()
        try:
            with self.engine.connect() as conn:
                return int(conn.execute(select(func.count()).select_from(quarantine)).scalar_one())
        except Exception as error:
            raise translate(error, self.url) from error

    def close(self) -> None:
        self._closed = True
        self.engine.dispose()
