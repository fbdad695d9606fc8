"""Fixtures for the fuzz targets: a real SQLite store behind the service."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvledger.ledger.store.connect import open_store


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path}/ledger.db"
    open_store(url, create=True).close()
    return url
