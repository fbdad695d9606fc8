"""`kvledger db ...`: create or upgrade a store's schema, and show its version."""

from __future__ import annotations

from typing import Annotated

import typer

from kvledger.ledger.store.base import StoreError
from kvledger.ledger.store.upgrade import upgrade_store

DEFAULT_DB = "sqlite:///kvledger.db"

db_app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)

DbUrl = Annotated[
    str,
    typer.Option("--db", envvar="KVLEDGER_DB", help="Store URL: sqlite:///file.db, a file path, or postgresql://..."),
]


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
    from kvledger.ledger.store.connect import open_store

    try:
        store = open_store(db)
    except StoreError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(1) from None
    from kvledger.ledger.store.schema import SCHEMA_VERSION

    store.close()
    typer.echo(f"{db}: schema at version {SCHEMA_VERSION}")
