"""`kvledger db upgrade`'s work: create a store's schema, or bring a known older one up to date."""

from __future__ import annotations

from sqlalchemy import inspect

from kvledger.ledger.store import migrate, schema
from kvledger.ledger.store.base import NotALedger, SchemaMismatch, StoreUnavailable
from kvledger.ledger.store.connect import connect_engine
from kvledger.ledger.store.errors import translate
from kvledger.ledger.store.url import parse_url

NATS_FORMAT = "nats-1"
"""What `db upgrade` reports for a NATS stream: it has no SQL schema; its message format is version 1."""


def upgrade_store(url: str) -> str:
    """Create the schema in an empty database or bring a known older one up to date; returns the version."""
    store_url = parse_url(url)
    if store_url.nats is not None:
        from kvledger.ledger.store.nats_store import NatsStore  # nats-py is needed by this store only

        NatsStore(store_url.nats, create=True).close()  # makes the stream and its side stores when missing
        return NATS_FORMAT
    if store_url.url is None:
        raise StoreUnavailable(f"{store_url.display}: the memory store has no schema to upgrade")
    engine = connect_engine(store_url, create=True)
    try:
        with engine.connect() as conn:
            tables = set(inspect(conn).get_table_names())
            found = migrate.current_version(conn, store_url.display) if schema.VERSION_TABLE in tables else None
        if schema.VERSION_TABLE not in tables and tables & {"events", "snapshots"}:
            raise NotALedger(f"{store_url.display}: holds an events table that kvledger did not create")
        if found is not None and found not in migrate.known_revisions():
            raise SchemaMismatch(
                f"{store_url.display}: unknown schema version {found} (newer than this kvledger, "
                f"which knows {schema.SCHEMA_VERSION}); upgrade kvledger, then run `kvledger db upgrade`"
            )
        migrate.upgrade_engine(engine, schema.SCHEMA_VERSION)
        with engine.connect() as conn:
            migrate.check_schema(conn, store_url.display)
        return schema.SCHEMA_VERSION
    except Exception as error:
        raise translate(error, store_url.display) from error
    finally:
        engine.dispose()
