"""Alembic environment: migrations run on the connection kvledger.ledger.store.migrate hands over.

Run by hand with `alembic -x db=URL upgrade head` (alembic.ini at the repo top points here), though
`kvledger db upgrade --db URL` is the supported way.
"""

from __future__ import annotations

import os

from alembic import context
from sqlalchemy import Connection

from kvledger.ledger.store.schema import VERSION_TABLE, metadata


def _run(connection: Connection) -> None:
    context.configure(connection=connection, target_metadata=metadata, version_table=VERSION_TABLE)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = context.config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    from kvledger.ledger.store.connect import create_store_engine, ensure_pg_schema
    from kvledger.ledger.store.url import parse_url

    url = context.get_x_argument(as_dictionary=True).get("db") or os.environ.get("KVLEDGER_DB")
    if not url:
        raise SystemExit("name the store: alembic -x db=URL ... (or set KVLEDGER_DB)")
    store_url = parse_url(url)
    engine = create_store_engine(store_url)
    try:
        ensure_pg_schema(engine, store_url, create=True)
        with engine.begin() as conn:
            _run(conn)
    finally:
        engine.dispose()


if context.is_offline_mode():
    raise SystemExit("offline (--sql) migrations are not supported; run against a database")
run_migrations_online()
