"""Schema management: upgrade from empty, and refusal of versions the code does not know."""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from typer.testing import CliRunner

from kvledger.cli.app import app
from kvledger.ledger.store import migrate, schema
from kvledger.ledger.store.base import SchemaMismatch, StoreError
from kvledger.ledger.store.connect import create_store_engine, ensure_pg_schema, open_store
from kvledger.ledger.store.url import parse_url

runner = CliRunner()

SQL_BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


@pytest.fixture(params=SQL_BACKENDS)
def sql_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'ledger.db'}"
    return str(request.getfixturevalue("pg_url"))


def _set_version(url: str, version: str) -> None:
    engine = create_store_engine(parse_url(url))
    with engine.begin() as conn:
        conn.execute(text(f"UPDATE {schema.VERSION_TABLE} SET version_num = :v"), {"v": version})
    engine.dispose()


def test_head_revision_is_the_code_version() -> None:
    assert migrate.known_revisions()[0] == schema.SCHEMA_VERSION


def test_upgrade_from_empty_with_the_cli(sql_url: str) -> None:
    result = runner.invoke(app, ["db", "upgrade", "--db", sql_url])
    assert result.exit_code == 0, result.output
    assert schema.SCHEMA_VERSION in result.output
    store = open_store(sql_url)
    assert store.count() == 0
    store.close()
    again = runner.invoke(app, ["db", "upgrade", "--db", sql_url])  # idempotent
    assert again.exit_code == 0, again.output


def test_open_without_create_names_the_command(sql_url: str) -> None:
    with pytest.raises(StoreError, match="kvledger db upgrade"):
        open_store(sql_url)


def test_newer_version_is_refused_naming_the_command(sql_url: str) -> None:
    open_store(sql_url, create=True).close()
    _set_version(sql_url, "0099_from_the_future")
    with pytest.raises(SchemaMismatch, match="unknown schema version 0099_from_the_future") as caught:
        open_store(sql_url)
    assert "kvledger db upgrade" in str(caught.value)
    result = runner.invoke(app, ["db", "upgrade", "--db", sql_url])
    assert result.exit_code == 1 and "newer" in result.output  # upgrade does not touch it either


def test_older_version_is_refused_then_upgraded(sql_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    open_store(sql_url, create=True).close()  # a database at this code's version
    head = schema.SCHEMA_VERSION
    # A kvledger one version on: same history plus one more revision.
    newer = tmp_path / "migrations"
    shutil.copytree(migrate.script_location(), newer, ignore=shutil.ignore_patterns("__pycache__"))
    (newer / "versions" / "9999_note.py").write_text(
        '"""A test revision."""\nimport sqlalchemy as sa\nfrom alembic import op\n'
        f'revision = "9999_note"\ndown_revision = "{head}"\nbranch_labels = None\ndepends_on = None\n\n'
        'def upgrade() -> None:\n    op.add_column("snapshots", sa.Column("note", sa.String(40)))\n\n'
        'def downgrade() -> None:\n    op.drop_column("snapshots", "note")\n'
    )
    monkeypatch.setattr(migrate, "script_location", lambda: newer)
    monkeypatch.setattr(schema, "SCHEMA_VERSION", "9999_note")
    with pytest.raises(SchemaMismatch, match="older than 9999_note") as caught:
        open_store(sql_url)
    assert "kvledger db upgrade --db" in str(caught.value)
    result = runner.invoke(app, ["db", "upgrade", "--db", sql_url])
    assert result.exit_code == 0, result.output
    open_store(sql_url).close()


def test_the_quarantine_migration_upgrades_a_first_version_store(sql_url: str) -> None:
    """A store made by the first kvledger (0001_initial) is refused, then upgraded in place, its events kept."""
    store_url = parse_url(sql_url)
    engine = create_store_engine(store_url)
    ensure_pg_schema(engine, store_url, create=True)
    migrate.upgrade_engine(engine, "0001_initial")
    engine.dispose()
    with pytest.raises(SchemaMismatch, match=f"0001_initial is older than {schema.SCHEMA_VERSION}"):
        open_store(sql_url)
    assert runner.invoke(app, ["db", "upgrade", "--db", sql_url]).exit_code == 0
    store = open_store(sql_url)
    assert store.quarantined_count() == 0
    store.close()


def test_the_store_id_migration_names_an_older_store_once_and_keeps_its_events(sql_url: str) -> None:
    """A store at 0002 is upgraded in place: a store id is drawn once, and every open after reads the same."""
    store_url = parse_url(sql_url)
    engine = create_store_engine(store_url)
    ensure_pg_schema(engine, store_url, create=True)
    migrate.upgrade_engine(engine, "0002_quarantine")
    engine.dispose()
    with pytest.raises(SchemaMismatch, match=f"0002_quarantine is older than {schema.SCHEMA_VERSION}"):
        open_store(sql_url)
    assert runner.invoke(app, ["db", "upgrade", "--db", sql_url]).exit_code == 0
    first = open_store(sql_url)
    named = first.store_id()
    first.close()
    again = open_store(sql_url)
    assert again.store_id() == named and len(named) == 32
    again.close()
    assert runner.invoke(app, ["db", "upgrade", "--db", sql_url]).exit_code == 0  # nothing drawn again
    third = open_store(sql_url)
    assert third.store_id() == named
    third.close()


def test_a_store_whose_id_row_was_removed_says_so(tmp_path: Path) -> None:
    url = _store_with_versions_changed(tmp_path / "x.db", "DELETE FROM kvledger_store")
    store = open_store(url)
    with pytest.raises(StoreError, match="kvledger_store holds no store ids"):
        store.store_id()
    store.close()


def test_create_upgrades_a_new_sqlite_file(tmp_path: Path) -> None:
    path = tmp_path / "new.db"
    open_store(str(path), create=True).close()
    tables = {r[0] for r in sqlite3.connect(path).execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"events", "snapshots", schema.VERSION_TABLE} <= tables
    assert sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone() == ("wal",)


def _store_with_versions_changed(path: Path, sql: str) -> str:
    """A new SQLite store at `path` whose version table `sql` then changed; its URL."""
    url = f"sqlite:///{path}"
    open_store(url, create=True).close()
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text(sql))
    engine.dispose()
    return url


def test_missing_version_row_is_refused(tmp_path: Path) -> None:
    url = _store_with_versions_changed(tmp_path / "x.db", f"DELETE FROM {schema.VERSION_TABLE}")
    with pytest.raises(SchemaMismatch, match=r"no schema version recorded.*kvledger db upgrade"):
        open_store(url)


def test_two_version_rows_are_refused_naming_the_store(tmp_path: Path) -> None:
    path = tmp_path / "x.db"
    second_row = f"INSERT INTO {schema.VERSION_TABLE} (version_num) VALUES ('0001_initial')"
    url = _store_with_versions_changed(path, second_row)
    with pytest.raises(SchemaMismatch, match=r"holds 2 versions") as caught:
        open_store(url)
    assert path.name in str(caught.value)
