"""The store contract every backend implements, and the store's error hierarchy.

One table of events keyed by `(source, seq)`, so many engines and ranks share a
store without colliding; a store-wide `cursor` (insertion order) gives a single
tail across sources. Backend errors are translated into `StoreError`s here at
the edge (eventsourcing style), so callers see the same failures on every backend.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple, Protocol

from kvledger.ledger.events import Event, TransferId
from kvledger.ledger.store.limits import QUARANTINE_READ_MAX


class StoreError(Exception):
    """Base of every error a store raises."""


class StoreUnavailable(StoreError):
    """The database cannot be reached or opened (URL, network, permissions)."""


class SchemaMismatch(StoreError):
    """The database's schema version is not the one this code knows; the message names the command."""


class NotALedger(StoreError):
    """The file or database exists but holds no kvledger schema."""


class ConflictError(StoreError):
    """An event with the same (source, seq) but different content is already stored."""


class UnstorableEvent(StoreError):
    """An event the store refuses for its content: not valid (`kvledger.ledger.valid`), or rejected by the database
    (a value its columns cannot hold). `index` is its position in the batch, when known; nothing of the
    batch was written. Retrying cannot help: a writer quarantines it."""

    def __init__(self, message: str, index: int | None = None) -> None:
        super().__init__(message)
        self.index = index


class Quarantined(NamedTuple):
    """An event the store refused for its content, kept aside with the reason (never retried)."""

    id: int
    created_ts: float
    source: str
    """The event's source (NUL characters replaced, so that every backend can hold it)."""
    seq: int | None
    """The event's seq, or None when that is not a 64-bit integer."""
    reason: str
    body: bytes
    """The whole event as one JSON line (`kvledger.ledger.events.to_json`): a person can read it, a tool reload it."""


class StoredSnapshot(NamedTuple):
    """An encoded LedgerState of one source after its event `seq` (see kvledger.ledger.store.snapshot)."""

    source: str
    seq: int
    format: int
    created_ts: float
    body: bytes


class Appended(NamedTuple):
    """What one append stored, so that its caller can fold it without reading it back."""

    inserted: list[tuple[int, Event]]
    """(cursor, event) of each event inserted, in cursor order (duplicates of stored events left out)."""
    after_cursor: int
    """The store's highest cursor when the batch's transaction began (0: empty): no other row lies
    between it and the first inserted one."""
    stored_max: dict[str, int]
    """For each source of the batch that had events stored before it, its highest seq then."""


class EventStore(Protocol):
    """What every backend (memory, SQLite, PostgreSQL) provides."""

    url: str

    def store_id(self) -> str:
        """The store's name, drawn once when the store was made and never changed: a snapshot names the store
        it was taken of, and a start refuses one taken of another (`kvledger.api.snapshots`). A copy of the whole store
        (a backup, a copied SQLite file) keeps it: its events are the same."""
        ...

    def append(self, events: Sequence[Event]) -> int:
        """Insert a batch in one transaction, all or nothing.

        Idempotent by `(source, seq)`: an event already stored with the same
        content is skipped; with different content raises `ConflictError` and
        nothing of the batch is written. Returns the number of rows inserted.
        """
        ...

    def append_returning(self, events: Sequence[Event], *, checked: bool = False) -> Appended:
        """`append`, returning what was inserted with its cursors and what was stored before it.

        `checked`: the caller has checked every event against `kvledger.ledger.valid` (ingest does, for the whole
        batch at once), so the store does not check each again."""
        ...

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
        """Stream events matching every given filter, in cursor (insertion) order.

        `after_seq` / `until_seq` apply per source (use with `source`).
        """
        ...

    def tail(self, after_cursor: int = 0, limit: int = 1000) -> list[tuple[int, Event]]:
        """Up to `limit` events after the store-wide `after_cursor`, with their cursors."""
        ...

    def sources(self) -> dict[str, int]:
        """Every source in the store and its highest stored seq."""
        ...

    def count(self) -> int: ...

    def count_through(self, cursor: int) -> int:
        """How many events are stored at store-wide cursors up to and including `cursor` (a fold that read
        the tail to `cursor` checks it read them all: none committed below it since)."""
        ...

    def save_snapshot(self, snapshot: StoredSnapshot) -> None:
        """Store a snapshot; saving the same (source, seq) again replaces it."""
        ...

    def latest_snapshot(self, source: str, max_seq: int | None = None) -> StoredSnapshot | None:
        """The snapshot of `source` with the highest seq (at most `max_seq`), if any."""
        ...

    def delete_snapshots(self, source: str, below_seq: int) -> int:
        """Delete `source`'s snapshots with a seq below `below_seq`; returns how many went."""
        ...

    def quarantine(self, items: Sequence[tuple[Event, str]]) -> int:
        """Keep `(event, reason)` pairs the store refused (`UnstorableEvent`, `ConflictError`) aside, in one
        transaction; they are never part of the log. Idempotent: an event already quarantined (same source
        and content) is not kept twice. Returns how many were new."""
        ...

    def quarantined(self, *, source: str | None = None, limit: int = QUARANTINE_READ_MAX) -> list[Quarantined]:
        """Quarantined events, oldest first (of `source` only, when given)."""
        ...

    def quarantined_count(self) -> int: ...

    def close(self) -> None: ...
