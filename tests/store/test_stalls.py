"""PostgreSQL calls are bounded: every connection has a lock and a statement timeout, so a lock held by
another session fails a call (StoreUnavailable: the writer spills and retries, the service says 503)
instead of hanging it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import pytest

from kvledger.ledger.store.base import StoreUnavailable
from kvledger.ledger.store.connect import open_store
from kvledger.ledger.store.limits import PG_LOCK_TIMEOUT_MS, PG_STATEMENT_TIMEOUT_MS
from kvledger.ledger.synth import SynthConfig, generate
from tests.store.conftest import PG_URL

pytestmark = pytest.mark.postgres

SHORT_LOCK_TIMEOUT = "&options=-c%20lock_timeout%3D300"
"""A test need not wait the default: libpq options in the URL come after the store's own."""


@contextmanager
def table_locked(schema: str) -> Iterator[None]:
    """Another session holding ACCESS EXCLUSIVE on the events table (what an ALTER TABLE takes)."""
    conn = psycopg.connect(PG_URL.replace("postgresql+psycopg://", "postgresql://"))
    try:
        conn.execute(f'LOCK TABLE "{schema}".events IN ACCESS EXCLUSIVE MODE')
        yield
    finally:
        conn.rollback()
        conn.close()


def test_every_connection_has_both_timeouts(pg_url: str) -> None:
    store = open_store(pg_url, create=True)
    with store.engine.connect() as conn:  # type: ignore[attr-defined]
        assert conn.exec_driver_sql("SHOW lock_timeout").scalar() == f"{PG_LOCK_TIMEOUT_MS // 1000}s"
        assert conn.exec_driver_sql("SHOW statement_timeout").scalar() == f"{PG_STATEMENT_TIMEOUT_MS // 1000}s"
    store.close()


def test_a_table_lock_held_elsewhere_fails_calls_instead_of_hanging_them(pg_url: str) -> None:
    schema = pg_url.rsplit("schema=", 1)[1]
    store = open_store(pg_url + SHORT_LOCK_TIMEOUT, create=True)
    events = list(generate(SynthConfig(transfers=5), seed=1))
    with table_locked(schema):
        with pytest.raises(StoreUnavailable, match="lock timeout"):
            store.append(events)
        with pytest.raises(StoreUnavailable, match="lock timeout"):
            store.tail(0, 10)
    assert store.append(events) == len(events)  # the lock gone, the same call goes through
    store.close()
