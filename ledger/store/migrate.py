"""The store's schema under Alembic: a programmatic Config (works from an installed package),
upgrade, and the version check every open runs."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, inspect

from ledger.store import schema
from ledger.store.base import NotALedger, SchemaMismatch

UPGRADE_COMMAND = "kvledger db upgrade --db {url}"


def script_location() -> Path:
    """The Alembic scripts (env.py, versions/), shipped inside this package wherever kvledger is installed."""
    return Path(__file__).resolve().parent / "migrations"


def alembic_config() -> Config:
    """An Alembic Config without an ini file; env.py takes the connection from its attributes."""
    config = Config()
    config.set_main_option("script_location", str(script_location()))
    return config


def known_revisions() -> list[str]:
    """Every revision of this code's migration history, newest first."""
    scripts = ScriptDirectory.from_config(alembic_config())
    return [revision.revision for revision in scripts.walk_revisions()]


def upgrade_engine(engine: Engine, revision: str = "head") -> None:
    """Run the migrations up to `revision` in one transaction."""
    config = alembic_config()
    with engine.begin() as conn:
        config.attributes["connection"] = conn
        command.upgrade(config, revision)


def current_version(conn: Connection) -> str | None:
    context = MigrationContext.configure(conn, opts={"version_table": schema.VERSION_TABLE})
    return context.get_current_revision()


def check_schema(conn: Connection, display: str) -> None:
    """Raise unless the database holds exactly the schema version this code knows."""
    upgrade = UPGRADE_COMMAND.format(url=display.split(" (schema ")[0])
    tables = set(inspect(conn).get_table_names())
    if schema.VERSION_TABLE not in tables:
        if not tables:
            raise NotALedger(f"{display}: empty database, no kvledger schema; create it with `{upgrade}`")
        listed = ", ".join(sorted(tables)[:5])
        raise NotALedger(f"{display}: not a kvledger store (it holds other tables: {listed})")
    found = current_version(conn)
    expected = schema.SCHEMA_VERSION
    if found == expected:
        return
    if found is None:
        raise SchemaMismatch(f"{display}: no schema version recorded (expected {expected}); run `{upgrade}`")
    if found in known_revisions():
        raise SchemaMismatch(
            f"{display}: schema version {found} is older than {expected}, the one this kvledger uses; run `{upgrade}`"
        )
    raise SchemaMismatch(
        f"{display}: unknown schema version {found} (this kvledger knows {expected}; a newer kvledger "
        f"wrote it?); use the kvledger that wrote it, or upgrade kvledger and run `{upgrade}`"
    )
