"""The wheel built from this tree installs one top-level name, kvledger, and runs from it alone: built from a copy
of what the build reads, installed into a fresh virtual environment, its modules load from there (no `ledger`,
`connector`, `api`, `cli`, `proxy` or `migrations` of the checkout), and its `kvledger db upgrade` finds the
migrations the wheel ships and creates the schema in a new SQLite file.

The environment sees site-packages (the heavy dependencies: torch, vLLM's) but not the wheel's build; the wheel
is built interpreted (`KVLEDGER_INTERPRETED=1`: compiling the fold takes minutes; the compiled modules' names are
what tests/ledger/test_both_builds.py loads)."""

from __future__ import annotations

import csv
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from kvledger.ledger.store.schema import SCHEMA_VERSION, VERSION_TABLE

ROOT = Path(__file__).resolve().parents[1]
OLD_NAMES = ("ledger", "connector", "api", "cli", "proxy", "migrations")
"""The top-level folders, which must never be top-level names where kvledger is installed."""
BUILD_FILES = ("pyproject.toml", "setup.py", "README.md")

pytestmark = pytest.mark.slow

PROBE = """
import importlib, json, sys
names = ["kvledger.ledger", "kvledger.ledger.fold", "kvledger.ledger.store.migrate", "kvledger.connector",
         "kvledger.api.app", "kvledger.cli.app", "kvledger.proxy"]
files = {name: importlib.import_module(name).__file__ for name in names}
from kvledger.ledger.store.migrate import known_revisions, script_location
print(json.dumps({"files": files, "migrations": str(script_location()), "revisions": known_revisions(),
                  "top": sorted({m.split(".")[0] for m in sys.modules})}))
"""


def _checkout_copy(destination: Path) -> Path:
    """What the build reads: its files, kvledger/ and the folders kvledger/ links to, without anything built."""
    destination.mkdir()
    for name in BUILD_FILES:
        shutil.copy2(ROOT / name, destination / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.c")
    shutil.copytree(ROOT / "kvledger", destination / "kvledger", symlinks=True, ignore=ignore)
    for link in (ROOT / "kvledger").iterdir():
        if link.is_symlink():
            shutil.copytree(ROOT / link.name, destination / link.name, ignore=ignore)
    return destination


def _wheel_top_level(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as archive:
        record = next(n for n in archive.namelist() if n.endswith(".dist-info/RECORD"))
        rows = csv.reader(archive.read(record).decode().splitlines())
        return {row[0].split("/")[0] for row in rows if row}


def test_the_wheel_installs_only_kvledger_and_upgrades_a_new_sqlite_store(tmp_path: Path) -> None:
    source = _checkout_copy(tmp_path / "src")
    wheels = tmp_path / "wheels"
    env = {**os.environ, "KVLEDGER_INTERPRETED": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels), "."],
        cwd=source, env=env, check=True, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    (wheel,) = wheels.glob("kvledger-*.whl")
    dist_info = wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1] + ".dist-info"
    assert _wheel_top_level(wheel) == {"kvledger", dist_info}
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        entry_points = archive.read(f"{dist_info}/entry_points.txt").decode()
    assert {"kvledger/migrations/env.py", "kvledger/migrations/script.py.mako"} <= names
    assert any(n.startswith("kvledger/migrations/versions/") and n.endswith(".py") for n in names)
    assert "kvledger.cli.app:app" in entry_points

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        env=env, check=True, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    site = next((env_dir / "lib").glob("python*/site-packages"))
    assert {p.name for p in site.iterdir()} == {"kvledger", dist_info}, "the wheel installed another top-level name"

    # -I: neither the working directory nor PYTHONPATH on sys.path; cwd outside the checkout besides.
    probe = subprocess.run(
        [str(python), "-I", "-c", PROBE], cwd=tmp_path, check=True, capture_output=True, text=True, timeout=120
    )
    found = json.loads(probe.stdout.strip().splitlines()[-1])
    for name, file in found["files"].items():
        assert Path(file).is_relative_to(site / "kvledger"), f"{name} loaded from {file}, not the wheel"
    assert Path(found["migrations"]) == site / "kvledger" / "migrations"
    assert found["revisions"][0] == SCHEMA_VERSION
    assert not set(OLD_NAMES) & set(found["top"]), f"a top-level name of the checkout was imported: {found['top']}"

    db = tmp_path / "x.db"
    done = subprocess.run(
        [str(env_dir / "bin" / "kvledger"), "db", "upgrade", "--db", f"sqlite:///{db}"],
        cwd=tmp_path, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        check=False, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"schema at version {SCHEMA_VERSION}" in done.stdout
    with sqlite3.connect(db) as conn:
        assert conn.execute(f"SELECT version_num FROM {VERSION_TABLE}").fetchall() == [(SCHEMA_VERSION,)]
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert {"events", "snapshots"} <= tables
