"""The store's schema under Alembic: a programmatic Config (works from an installed package),
upgrade, and the version check every open runs.

Alembic is imported only to upgrade or to list its revisions: the check every open runs reads Alembic's
version table with a plain query (importing Alembic was a seventh of a second of every service start and
CLI command)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import Column, Connection, Engine, MetaData, String, Table, inspect, select

from kvledger.ledger.store import schema
from kvledger.ledger.store.base import NotALedger, SchemaMismatch, StoreError

if TYPE_CHECKING:
    from alembic.config import Config

UPGRADE_COMMAND = "kvledger db upgrade --db {url}"


MIGRATIONS = "kvledger.migrations"
"""The package of the Alembic scripts: the repository's top-level migrations/, installed as kvledger/migrations."""


def script_location() -> Path:
    """The Alembic scripts (env.py, versions/), wherever kvledger is installed. Located by name, never imported:
    env.py imports the store, so the scripts sit above it, and the store imports nothing above it."""
    spec = importlib.util.find_spec(MIGRATIONS)
    if spec is None or not spec.submodule_search_locations:
        raise StoreError(f"{MIGRATIONS} is not installed (Alembic's scripts): reinstall kvledger")
    return Path(next(iter(spec.submodule_search_locations))).resolve()


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
