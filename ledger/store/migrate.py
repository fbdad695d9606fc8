"""The store's schema under Alembic: a programmatic Config (works from an installed package),
upgrade, and the version check every open runs.

Alembic is imported only to upgrade or to list its revisions: the check every open runs reads Alembic's
version table with a plain query (importing Alembic was a seventh of a second of every service start and
CLI command)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import Column, Connection, Engine, MetaData, String, Table, inspect, select

from ledger.store import schema
from ledger.store.base import NotALedger, SchemaMismatch

if TYPE_CHECKING:
    from alembic.config import Config

UPGRADE_COMMAND = "kvledger db upgrade --db {url}"


def script_location() -> Path:
    """The Alembic scripts (env.py, versions/), shipped inside this package wherever kvledger is installed."""
    return Path(__file__).resolve().parent / "migrations"


_versions = Table(schema.VERSION_TABLE, MetaData(), Column("version_num", String(32), primary_key=True))
"""Alembic's version table as Alembic creates it (`schema.VERSION_TABLE`): one row, the revision."""


def alembic_config() -> Config:
    """An Alembic Config without an ini file; env.py takes the connection from its attributes."""
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(script_location()))
    return config


def known_revisions() -> list[str]:
    """Every revision of this code's migration history, newest first."""
    from alembic.script import ScriptDirectory

    scripts = ScriptDirectory.from_config(alembic_config())
    return [revision.revision for revision in scripts.walk_revisions()]


def upgrade_engine(engine: Engine, revision: str = "head") -> None:
    """Run the migrations up to `revision` in one transaction."""
    from alembic import command

    config = alembic_config()
    with engine.begin() as conn:
        config.attributes["connection"] = conn
        command.upgrade(config, revision)


def current_version(conn: Connection, display: str) -> str | None:
    """The revision Alembic's version table records (None: none) in the store `display` names. Call it
    where the table exists."""
    found = [row[0] for row in conn.execute(select(_versions.c.version_num))]
    if len(found) > 1:  # branches merged by hand, or another tool's rows: no one version this code can trust
        raise SchemaMismatch(f"{display}: its schema version table {schema.VERSION_TABLE} holds {len(found)} "
                             f"versions ({', '.join(found)}), where kvledger keeps one")  # fmt: skip
    return found[0] if found else None


def check_schema(conn: Connection, display: str) -> None:
    """Raise unless the database holds exactly the schema version this code knows."""
    upgrade = UPGRADE_COMMAND.format(url=display.split(" (schema ")[0])
    tables = set(inspect(conn).get_table_names())
    if schema.VERSION_TABLE not in tables:
        if not tables:
            raise NotALedger(f"{display}: empty database, no kvledger schema; create it with `{upgrade}`")
        listed = ", ".join(sorted(tables)[:5])
        raise NotALedger(f"{display}: not a kvledger store (it holds other tables: {listed})")
    found = current_version(conn, display)
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
