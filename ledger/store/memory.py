"""The in-memory store: the same contract as SQLite and PostgreSQL, for tests and ephemeral runs."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator, Sequence

from kvledger.ledger.events import Event, TransferId
from kvledger.ledger.store.base import Appended, ConflictError, Quarantined, StoredSnapshot, StoreError
from kvledger.ledger.store.limits import QUARANTINE_READ_MAX, TAIL_EVENTS_MAX
from kvledger.ledger.store.rows import checked_row, encode_row, quarantine_row


class MemoryStore:
    """Events in a list in cursor order plus an index by (source, seq); snapshots in a dict."""

    def __init__(self, url: str = "memory://") -> None:
        self.url = url
        self._rows: list[tuple[int, Event]] = []
        self._bodies: dict[tuple[str, int], bytes] = {}
        self._max_seq: dict[str, int] = {}
        self._snapshots: dict[str, dict[int, StoredSnapshot]] = {}
        self._quarantine: list[Quarantined] = []
        self._lock = threading.Lock()
        self._closed = False
        self._id = uuid.uuid4().hex

    def store_id(self) -> str:
        return self._id

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"{self.url}: store is closed")

    def append(self, events: Sequence[Event]) -> int:
        return len(self.append_returning(events).inserted)

    def append_returning(self, events: Sequence[Event], *, checked: bool = False) -> Appended:
        with self._lock:
            self._check_open()
            fresh: dict[tuple[str, int], tuple[Event, bytes]] = {}
            stored_max: dict[str, int] = {}
            for i, event in enumerate(events):
                row = checked_row(event) if checked else encode_row(event, i)
                key = (event.source, event.seq)
                if event.source in self._max_seq:
                    stored_max[event.source] = self._max_seq[event.source]
                stored = self._bodies.get(key)
                if stored is None and key in fresh:
                    stored = fresh[key][1]
                if stored is not None:
                    if stored != row[5]:
                        raise ConflictError(
                            f"{self.url}: {event.source!r} seq {event.seq} is stored with different content"
                        )
                    continue
                fresh[key] = (event, row[5])
            after_cursor = cursor = len(self._rows)
            inserted: list[tuple[int, Event]] = []
            for key, (event, body) in fresh.items():
                cursor += 1
                inserted.append((cursor, event))
                self._bodies[key] = body
                if key[1] > self._max_seq.get(key[0], 0):
                    self._max_seq[key[0]] = key[1]
            self._rows.extend(inserted)
            return Appended(inserted, after_cursor, stored_max)

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
        with self._lock:
            self._check_open()
            rows = list(self._rows)  # a consistent view, like a read transaction
        emitted = 0
        for _, event in rows:
            if limit is not None and emitted >= limit:
                return
            if (
                (source is not None and event.source != source)
                or event.seq <= after_seq
                or (until_seq is not None and event.seq > until_seq)
                or (transfer_id is not None and event.transfer_id != transfer_id)
                or (ts_from is not None and event.ts < ts_from)
                or (ts_to is not None and event.ts > ts_to)
            ):
                continue
            emitted += 1
            yield event

    def tail(self, after_cursor: int = 0, limit: int = 1000) -> list[tuple[int, Event]]:
        with self._lock:
            self._check_open()
            # Cursors are 1..n in list order, so the list index is the cursor.
            return self._rows[max(0, after_cursor) : max(0, after_cursor) + min(limit, TAIL_EVENTS_MAX)]

    def sources(self) -> dict[str, int]:
        with self._lock:
            self._check_open()
            return dict(self._max_seq)

    def count(self) -> int:
        with self._lock:
            self._check_open()
            return len(self._rows)

    def count_through(self, cursor: int) -> int:
        with self._lock:
            self._check_open()
            return min(max(0, cursor), len(self._rows))  # cursors are 1..n in list order

    def delete_snapshots(self, source: str, below_seq: int) -> int:
        with self._lock:
            self._check_open()
            stored = self._snapshots.get(source, {})
            gone = [seq for seq in stored if seq < below_seq]
            for seq in gone:
                del stored[seq]
            return len(gone)

    def save_snapshot(self, snapshot: StoredSnapshot) -> None:
        with self._lock:
            self._check_open()
            self._snapshots.setdefault(snapshot.source, {})[snapshot.seq] = snapshot

    def latest_snapshot(self, source: str, max_seq: int | None = None) -> StoredSnapshot | None:
        with self._lock:
            self._check_open()
            seqs = [s for s in self._snapshots.get(source, {}) if max_seq is None or s <= max_seq]
            return self._snapshots[source][max(seqs)] if seqs else None

    def quarantine(self, items: Sequence[tuple[Event, str]]) -> int:
        with self._lock:
            self._check_open()
            before = len(self._quarantine)
            for event, reason in items:
                row = quarantine_row(event, reason)
                if any(q.source == row[1] and q.body == row[4] for q in self._quarantine):
                    continue  # idempotent, like append
                self._quarantine.append(Quarantined(len(self._quarantine) + 1, *row))
            return len(self._quarantine) - before

    def quarantined(self, *, source: str | None = None, limit: int = QUARANTINE_READ_MAX) -> list[Quarantined]:
        with self._lock:
            self._check_open()
            found = [q for q in self._quarantine if source is None or q.source == source]
        return found[-min(limit, QUARANTINE_READ_MAX) :]

    def quarantined_count(self) -> int:
        with self._lock:
            self._check_open()
            return len(self._quarantine)

    def close(self) -> None:
        self._closed = True
