"""Fixtures for the service tests: real SQLite and PostgreSQL stores, a TestClient, a uvicorn thread."""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, make_url

from kvledger.api.app import create_app
from kvledger.api.server import server_config
from kvledger.api.settings import Settings
from kvledger.ledger.store.connect import open_store
from tests.api.seed import incident_events

TOKEN = "test-token-not-secret"
PG_URL = os.environ.get("KVLEDGER_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
SERVER_START_POLLS_MAX = 2_000


def settings_for(url: str, **overrides: object) -> Settings:
    return Settings(db=url, token=TOKEN, poll_interval_s=0.05, **overrides)  # type: ignore[arg-type]


def seed(url: str) -> None:
    store = open_store(url)
    try:
        store.append(incident_events())
    finally:
        store.close()


@pytest.fixture
def sqlite_url(tmp_path: object) -> str:
    url = f"sqlite:///{tmp_path}/ledger.db"
    open_store(url, create=True).close()
    return url


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A fresh schema of its own in the test PostgreSQL database, dropped afterwards."""
    schema = f"kvledger_api_{uuid.uuid4().hex[:10]}"
    url = f"{PG_URL}?schema={schema}"
    open_store(url, create=True).close()
    yield url
    engine = create_engine(make_url(PG_URL).set(drivername="postgresql+psycopg"))
    with engine.begin() as conn:
        conn.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    engine.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store_url(request: pytest.FixtureRequest) -> str:
    """Each real backend in turn."""
    name = "sqlite_url" if request.param == "sqlite" else "pg_url"
    url: str = request.getfixturevalue(name)
    return url


@pytest.fixture
def seeded_url(sqlite_url: str) -> str:
    seed(sqlite_url)
    return sqlite_url


@pytest.fixture
def client(seeded_url: str) -> Iterator[TestClient]:
    with TestClient(create_app(settings_for(seeded_url))) as test_client:
        yield test_client


class ServerThread:
    """uvicorn serving `app` on a free loopback port in a daemon thread, configured as `kvledger serve` is."""

    def __init__(self, app: FastAPI) -> None:
        config = server_config(app, app.state.settings, host="127.0.0.1", port=0, log_level="warning")
        config.timeout_graceful_shutdown = 2
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.started = threading.Event()

    def __enter__(self) -> str:
        self.thread.start()
        for _ in range(SERVER_START_POLLS_MAX):
            if self.server.started or not self.thread.is_alive():
                break
            self.thread.join(0.01)
        assert self.server.started, "uvicorn did not start"
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join()


@pytest.fixture
def served(store_url: str) -> Iterator[tuple[str, str]]:
    """(base URL, store URL) of a real server over a seeded real store."""
    seed(store_url)
    with ServerThread(create_app(settings_for(store_url))) as base:
        yield base, store_url


def wait_for(predicate: object, polls_max: int = 500, interval_s: float = 0.02) -> None:
    """Poll until `predicate()` holds; fails after `polls_max` polls (a bound, not a timing claim)."""
    event = threading.Event()
    for _ in range(polls_max):
        if predicate():  # type: ignore[operator]
            return
        event.wait(interval_s)
    raise AssertionError(f"condition never held after {polls_max} polls")


def http(base: str) -> httpx.Client:
    return httpx.Client(base_url=base, timeout=30)
