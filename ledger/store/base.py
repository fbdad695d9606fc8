"""The store contract every backend implements, and the store's error hierarchy.

One table of events keyed by `(source, seq)`, so many engines and ranks share a
store without colliding; a store-wide `cursor` (insertion order) gives a single
tail across sources. Backend errors are translated into `StoreError`s here at
the edge (eventsourcing style), so callers see the same failures on every backend.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple, Protocol

from ledger.events import Event, TransferId


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


class StoredSnapshot(NamedTuple):
    """An encoded LedgerState of one source after its event `seq` (see ledger.store.snapshot)."""

    source: str
    seq: int
    format: int
    created_ts: float
    body: bytes


class EventStore(Protocol):
    """What every backend (memory, SQLite, PostgreSQL) provides."""

    url: str

    def append(self, events: Sequence[Event]) -> int:
        """Insert a batch in one transaction, all or nothing.

        Idempotent by `(source, seq)`: an event already stored with the same
        content is skipped; with different content raises `ConflictError` and
        nothing of the batch is written. Returns the number of rows inserted.
        """
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

    def save_snapshot(self, snapshot: StoredSnapshot) -> None:
        """Store a snapshot; saving the same (source, seq) again replaces it."""
        ...

    def latest_snapshot(self, source: str, max_seq: int | None = None) -> StoredSnapshot | None:
        """The snapshot of `source` with the highest seq (at most `max_seq`), if any."""
        ...

    def close(self) -> None: ...
