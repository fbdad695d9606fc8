"""`kvledger db ...`: create or upgrade a store's schema, and show its version."""

from __future__ import annotations

from typing import Annotated

import typer

from ledger.store.base import NotALedger, SchemaMismatch, StoreError, StoreUnavailable

DEFAULT_DB = "sqlite:///kvledger.db"

db_app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)

DbUrl = Annotated[
    str,
    typer.Option("--db", envvar="KVLEDGER_DB", help="Store URL: sqlite:///file.db, a file path, or postgresql://..."),
]


def upgrade_store(url: str) -> str:
    """Create the schema in an empty database or bring a known older one up to date; returns the version."""
    from sqlalchemy import inspect

    from ledger.store import migrate, schema
    from ledger.store.connect import check_sqlite_path, create_store_engine, ensure_pg_schema, parse_url
    from ledger.store.errors import translate

    store_url = parse_url(url)
    if store_url.url is None:
        raise StoreUnavailable(f"{store_url.display}: the memory store has no schema to upgrade")
    if store_url.is_sqlite:
        check_sqlite_path(store_url, create=True)
    engine = create_store_engine(store_url)
    try:
        ensure_pg_schema(engine, store_url, create=True)
        with engine.connect() as conn:
            tables = set(inspect(conn).get_table_names())
            found = migrate.current_version(conn) if schema.VERSION_TABLE in tables else None
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


@db_app.command()
def upgrade(db: DbUrl = DEFAULT_DB) -> None:
    """Create the store's tables, or migrate them to the version this kvledger uses."""
    try:
        version = upgrade_store(db)
    except StoreError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"{db}: schema at version {version}")


@db_app.command()
def current(db: DbUrl = DEFAULT_DB) -> None:
    """Print the store's schema version; exit 1 when kvledger cannot use it as is."""
    from ledger.store.connect import open_store

    try:
        store = open_store(db)
    except StoreError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(1) from None
    from ledger.store.schema import SCHEMA_VERSION

    store.close()
    typer.echo(f"{db}: schema at version {SCHEMA_VERSION}")
