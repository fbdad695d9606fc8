"""Open a store by URL (parsed by `url.py`): `memory://`, a SQLite file (the embedded default),
PostgreSQL (psycopg 3) or a NATS JetStream stream (`nats_store.py`).

Every PostgreSQL connection carries a `lock_timeout` and a `statement_timeout` (named in
`limits.py`), so a lock held elsewhere or a stuck statement fails a call instead of
hanging it; libpq's `options` in the URL (`?options=-c%20lock_timeout%3D500`) come after
ours and win.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine, create_engine, event, inspect, text
from sqlalchemy.engine import URL

from kvledger.ledger.store.base import EventStore, StoreUnavailable
from kvledger.ledger.store.errors import translate
from kvledger.ledger.store.limits import (
    PG_CONNECT_TIMEOUT_S,
    PG_LOCK_TIMEOUT_MS,
    PG_STATEMENT_TIMEOUT_MS,
    SQLITE_BUSY_TIMEOUT_MS,
)
from kvledger.ledger.store.url import StoreUrl, parse_url

SQLITE_SYNCHRONOUS = "NORMAL"
"""WAL + NORMAL: a commit survives a crash of the process (SIGKILL) but the last commits
may be lost on power failure or an OS crash; the database is never corrupted.
FULL would fsync the WAL on every commit (one fsync per batch). See docs/store.md, "SQLite durability"."""


def _sqlite_engine(url: URL) -> Engine:
    engine = create_engine(
        url,
        # Autocommit at the driver, so that the begin hook below decides how transactions start.
        connect_args={
            "isolation_level": None,
            "timeout": SQLITE_BUSY_TIMEOUT_MS / 1000,
            "check_same_thread": False,
        },
    )

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA journal_mode = WAL")
        cursor.execute(f"PRAGMA synchronous = {SQLITE_SYNCHRONOUS}")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Any) -> None:
        # A writer takes the write lock up front: a read-then-write transaction could otherwise
        # fail with SQLITE_BUSY on the upgrade without waiting for busy_timeout.
        write = connection.get_execution_options().get("kvledger_write", False)
        connection.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")

    return engine


def _postgres_engine(url: URL, schema: str | None) -> Engine:
    options = [f"-c lock_timeout={PG_LOCK_TIMEOUT_MS}", f"-c statement_timeout={PG_STATEMENT_TIMEOUT_MS}"]
    if schema:
        # search_path puts every statement (ours, Alembic's, raw SQL) in the ledger's schema.
        options.append(f"-c search_path={schema}")
    query = dict(url.query)
    extra = query.pop("options", None)
    if isinstance(extra, str):
        options.append(extra)  # the URL's own, last: PostgreSQL takes the last value of a setting
    connect_args: dict[str, Any] = {"connect_timeout": PG_CONNECT_TIMEOUT_S, "options": " ".join(options)}
    return create_engine(url.set(query=query), pool_pre_ping=True, connect_args=connect_args)


def create_store_engine(store_url: StoreUrl) -> Engine:
    assert store_url.url is not None, "the memory store has no engine"
    if store_url.is_sqlite:
        return _sqlite_engine(store_url.url)
    return _postgres_engine(store_url.url, store_url.schema)


def check_sqlite_path(store_url: StoreUrl, *, create: bool) -> None:
    """A missing file is an error unless creating; SQLite would silently create an empty one."""
    path = store_url.sqlite_path
    assert path is not None, "not a SQLite store"
    if path.is_dir():
        raise StoreUnavailable(f"{store_url.display}: {path} is a directory, not a store file")
    if not path.exists():
        if not create:
            raise StoreUnavailable(
                f"{store_url.display}: no such file {path}; create it with "
                f"`kvledger db upgrade --db {store_url.display}`"
            )
        if not path.parent.is_dir():
            raise StoreUnavailable(f"{store_url.display}: directory {path.parent} does not exist")


def ensure_pg_schema(engine: Engine, store_url: StoreUrl, *, create: bool) -> None:
    """Create the PostgreSQL schema named in the URL when creating; otherwise it must exist."""
    if not (store_url.is_postgres and store_url.schema):
        return
    with engine.begin() as conn:
        found = conn.execute(
            text("SELECT 1 FROM information_schema.schemata WHERE schema_name = :s"), {"s": store_url.schema}
        ).first()
        if found is None:
            if not create:
                raise StoreUnavailable(
                    f"{store_url.display}: schema {store_url.schema!r} does not exist; create it with "
                    f"`kvledger db upgrade --db URL`"
                )
            conn.exec_driver_sql(f'CREATE SCHEMA IF NOT EXISTS "{store_url.schema}"')


def connect_engine(store_url: StoreUrl, *, create: bool) -> Engine:
    """An engine on the database of `store_url` (not the memory store): the SQLite file's folder checked
    (made, with `create`), the PostgreSQL schema there (made, with `create`). Failures name the store."""
    if store_url.is_sqlite:
        check_sqlite_path(store_url, create=create)
    engine = create_store_engine(store_url)
    try:
        ensure_pg_schema(engine, store_url, create=create)
    except BaseException as error:
        engine.dispose()
        if isinstance(error, Exception):
            raise translate(error, store_url.display) from error
        raise
    return engine


def open_store(url: str | StoreUrl, *, create: bool = False, schema: str | None = None) -> EventStore:
    """Open the store at `url` (a URL, or one already parsed: `schema` then applies to a URL string only),
    checking its schema version; `create` makes a new empty one.

    Refuses (SchemaMismatch, naming `kvledger db upgrade`) a database whose schema
    version this code does not know, and (NotALedger) one that holds other tables.
    """
    # Imported here: the SQL backend and Alembic are not needed by the memory store.
    from kvledger.ledger.store import migrate
    from kvledger.ledger.store.memory import MemoryStore
    from kvledger.ledger.store.sql import SqlStore

    store_url = parse_url(url, schema=schema) if isinstance(url, str) else url
    if store_url.nats is not None:
        from kvledger.ledger.store.nats_store import NatsStore  # nats-py is needed by this store only

        return NatsStore(store_url.nats, create=create)
    if store_url.url is None:
        return MemoryStore(store_url.display)
    engine = connect_engine(store_url, create=create)
    try:
        with engine.connect() as conn:
            empty = not inspect(conn).get_table_names()
        if empty and create:
            migrate.upgrade_engine(engine)
        with engine.connect() as conn:
            migrate.check_schema(conn, store_url.display)
    except BaseException as error:
        engine.dispose()
        if isinstance(error, Exception):
            raise translate(error, store_url.display) from error
        raise
    return SqlStore(engine, store_url)
