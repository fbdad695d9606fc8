"""The store's tables as SQLAlchemy Core metadata; Alembic's migrations are checked against it."""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Column,
    Double,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    Text,
    UniqueConstraint,
)

from kvledger.ledger.limits import SOURCE_CHARS_MAX, TRANSFER_ID_CHARS_MAX
from kvledger.ledger.store.limits import KIND_CHARS_MAX

SCHEMA_VERSION = "0003_store_id"
"""The Alembic revision this code reads and writes; any other is refused at open."""

VERSION_TABLE = "kvledger_version"
"""Alembic's version table, named for us so that it never collides with an application's own."""

metadata = MetaData()

# SQLite only makes INTEGER PRIMARY KEY an alias of the rowid (autoincrementing, no extra index).
_Cursor = BigInteger().with_variant(Integer(), "sqlite")

events = Table(
    "events",
    metadata,
    Column("cursor", _Cursor, primary_key=True, autoincrement=True),
    Column("source", String(SOURCE_CHARS_MAX), nullable=False),
    Column("seq", BigInteger, nullable=False),
    Column("ts", Double, nullable=False),
    Column("kind", String(KIND_CHARS_MAX), nullable=False),
    Column("transfer_id", String(TRANSFER_ID_CHARS_MAX), nullable=False),
    Column("body", LargeBinary, nullable=False),  # msgpack of the whole event (kvledger.ledger.events.to_msgpack)
    UniqueConstraint("source", "seq", name="events_source_seq"),
    Index("events_transfer_id", "transfer_id"),
    Index("events_ts", "ts"),
)
"""One row per event; `(source, seq)` is its identity, `cursor` the store-wide insertion order."""

snapshots = Table(
    "snapshots",
    metadata,
    Column("source", String(SOURCE_CHARS_MAX), nullable=False),
    Column("seq", BigInteger, nullable=False),
    Column("created_ts", Double, nullable=False),
    Column("format", Integer, nullable=False),
    Column("body", LargeBinary, nullable=False),
    PrimaryKeyConstraint("source", "seq", name="snapshots_pkey"),
)
"""A source's folded LedgerState after its event `seq` (kvledger.ledger.store.snapshot encodes it)."""

quarantine = Table(
    "quarantine",
    metadata,
    Column("id", _Cursor, primary_key=True, autoincrement=True),
    Column("created_ts", Double, nullable=False),
    Column("source", Text, nullable=False),
    Column("seq", BigInteger, nullable=True),
    Column("reason", Text, nullable=False),
    Column("body", LargeBinary, nullable=False),  # the event as one JSON line (kvledger.ledger.events.to_json)
)
"""Events a store refused for their content (invalid, or a (source, seq) stored with other content), with
why: set aside by a background writer so that one bad event never stalls it, and shown by the service.
Unbounded text columns: the event that did not fit the events table must fit here."""

STORE_ID_CHARS_MAX = 64

identity = Table(
    "kvledger_store",
    metadata,
    Column("store_id", String(STORE_ID_CHARS_MAX), primary_key=True),
    Column("created_ts", Double, nullable=False),
)
"""One row: the store's id (a random hex string), drawn by the migration that made the table (when the store
was made, or upgraded to 0003), never written again. A snapshot names it (`EventStore.store_id`)."""
