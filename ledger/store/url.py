"""A store URL parsed once: which backend, where its file is, and how to print it.

`memory://`, a SQLite file (`sqlite:///path/to/ledger.db` or a bare file path) or PostgreSQL
(`postgresql+psycopg://user@host/db`; plain `postgresql://` and `postgres://` are rewritten to
psycopg), with an optional `?schema=name` for PostgreSQL so that several ledgers share one database,
or a NATS JetStream stream (`nats://host:4222/stream`, settings in `nats_stream.py`).
Everything that asks "which store is this?" (opening it, the connector's spill folder, log lines)
reads the one `StoreUrl`, never the raw string.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import exc, make_url
from sqlalchemy.engine import URL

from kvledger.ledger.store.base import StoreUnavailable
from kvledger.ledger.store.nats_stream import NATS_SCHEME, NatsTarget, parse_nats_url

MEMORY_URL = "memory://"


@dataclass(frozen=True)
class StoreUrl:
    """A parsed store URL: the SQLAlchemy URL, the PostgreSQL schema, and a printable form."""

    url: URL | None  # None for the memory store and NATS
    schema: str | None
    display: str
    """Safe for logs and messages: the password is hidden."""
    nats: NatsTarget | None = None

    @property
    def is_memory(self) -> bool:
        return self.url is None and self.nats is None

    @property
    def is_nats(self) -> bool:
        return self.nats is not None

    @property
    def is_sqlite(self) -> bool:
        return self.url is not None and self.url.get_backend_name() == "sqlite"

    @property
    def is_postgres(self) -> bool:
        return self.url is not None and self.url.get_backend_name() == "postgresql"

    @property
    def sqlite_path(self) -> Path | None:
        """The SQLite store's file (as written: relative paths stay relative); None for other stores."""
        if not self.is_sqlite:
            return None
        assert self.url is not None and self.url.database
        return Path(self.url.database)


def parse_url(raw: str, *, schema: str | None = None) -> StoreUrl:
    """Check and normalise a store URL; raises StoreUnavailable naming it when it cannot be used."""
    if raw in (MEMORY_URL, "memory:"):
        return StoreUrl(None, None, MEMORY_URL)
    if raw.startswith(f"{NATS_SCHEME}://"):
        target = parse_nats_url(raw)
        return StoreUrl(None, None, target.display, target)
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
        f"{display}: unsupported store {backend!r}; use sqlite:///path, postgresql://..., nats://host:4222/stream or memory://"
    )
