"""Open a store by URL: `memory://`, a SQLite file (the embedded default) or PostgreSQL (psycopg 3).

URLs: `sqlite:///path/to/ledger.db` (or a bare file path), `postgresql+psycopg://user@host/db`
(plain `postgresql://` and `postgres://` are rewritten to psycopg), with an optional
`?schema=name` for PostgreSQL so that several ledgers share one database.

Every PostgreSQL connection carries a `lock_timeout` and a `statement_timeout` (named in
`limits.py`), so a lock held elsewhere or a stuck statement fails a call instead of
hanging it; libpq's `options` in the URL (`?options=-c%20lock_timeout%3D500`) come after
ours and win.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event, exc, inspect, make_url, text
from sqlalchemy.engine import URL

from ledger.store.base import EventStore, StoreUnavailable
from ledger.store.errors import translate
from ledger.store.limits import (
    PG_CONNECT_TIMEOUT_S,
    PG_LOCK_TIMEOUT_MS,
    PG_STATEMENT_TIMEOUT_MS,
    SQLITE_BUSY_TIMEOUT_MS,
)

SQLITE_SYNCHRONOUS = "NORMAL"
"""WAL + NORMAL: a commit survives a crash of the process (SIGKILL) but the last commits
may be lost on power failure or an OS crash; the database is never corrupted.
FULL would fsync the WAL on every commit (one fsync per batch). See ledger/store/README.md."""

MEMORY_URL = "memory://"


@dataclass(frozen=True)
class StoreUrl:
    """A parsed store URL: the SQLAlchemy URL, the PostgreSQL schema, and a printable form."""

    url: URL | None  # None for the memory store
    schema: str | None
    display: str

    @property
    def is_sqlite(self) -> bool:
        return self.url is not None and self.url.get_backend_name() == "sqlite"

    @property
    def is_postgres(self) -> bool:
        return self.url is not None and self.url.get_backend_name() == "postgresql"


def parse_url(raw: str, *, schema: str | None = None) -> StoreUrl:
    """Check and normalise a store URL; raises StoreUnavailable naming it when it cannot be used."""
    if raw in (MEMORY_URL, "memory:"):
        return StoreUrl(None, None, MEMORY_URL)
    if "://" not in raw:
        # A bare path is a SQLite file, so a store file is accepted wherever a log path is.
        return StoreUrl(URL.create("sqlite", database=str(Path(raw))), None, raw)
    try:
        url = make_url(raw)
    except (exc.ArgumentError, ValueError) as error:
        raise StoreUnavailable(f"{raw}: not a store URL ({error})") from None
    display = url.render_as_string(hide_password=True)
    backend, _, driver = url.drivername.partition("+")
    if backend in ("postgresql", "postgres"):
        if driver not in ("", "psycopg"):
            raise StoreUnavailable(f"{display}: driver {driver!r} is not supported; use postgresql+psycopg://")
        query = dict(url.query)
        url_schema = query.pop("schema", None)
        url = url.set(drivername="postgresql+psycopg", query=query)
        chosen = schema or (url_schema if isinstance(url_schema, str) else None)
        return StoreUrl(
            url, chosen, url.render_as_string(hide_password=True) + (f" (schema {chosen})" if chosen else "")
        )
    if backend == "sqlite":
        if not url.database or url.database == ":memory:":
            raise StoreUnavailable(f"{display}: an in-memory SQLite store is not supported; use {MEMORY_URL}")
        return StoreUrl(url.set(drivername="sqlite"), None, display)
    raise StoreUnavailable(
        f"{display}: unsupported store {backend!r}; use sqlite:///path, postgresql://... or memory://"
    )


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
    assert store_url.url is not None and store_url.url.database
    path = Path(store_url.url.database)
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


def open_store(url: str, *, create: bool = False, schema: str | None = None) -> EventStore:
    """Open the store at `url`, checking its schema version; `create` makes a new empty one.

    Refuses (SchemaMismatch, naming `kvledger db upgrade`) a database whose schema
    version this code does not know, and (NotALedger) one that holds other tables.
    """
    # Imported here: the SQL backend and Alembic are not needed by the memory store.
    from ledger.store import migrate
    from ledger.store.memory import MemoryStore
    from ledger.store.sql import SqlStore

    store_url = parse_url(url, schema=schema)
    if store_url.url is None:
        return MemoryStore(store_url.display)
    if store_url.is_sqlite:
        check_sqlite_path(store_url, create=create)
    engine = create_store_engine(store_url)
    try:
        ensure_pg_schema(engine, store_url, create=create)
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
