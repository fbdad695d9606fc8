"""Fixtures for the store tests: one store per backend (memory, SQLite file, PostgreSQL schema), a TCP proxy."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvledger.ledger.events import Event
from kvledger.ledger.partition import partition_of_event
from kvledger.ledger.store.base import EventStore
from kvledger.ledger.store.connect import open_store
from tests.store.nats_server import NatsServer

PG_URL = os.environ.get("KVLEDGER_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
SKIP_PG = os.environ.get("KVLEDGER_SKIP_PG") == "1"
NATS_URL = os.environ.get("KVLEDGER_TEST_NATS_URL", "nats://127.0.0.1:4222")
"""The shared NATS (JetStream on); tests make streams of their own in it and delete them, never stop it."""
SKIP_NATS = os.environ.get("KVLEDGER_SKIP_NATS") == "1"


def _pg_admin() -> object:
    import psycopg

    return psycopg.connect(PG_URL.replace("postgresql+psycopg://", "postgresql://"), autocommit=True, connect_timeout=5)


@pytest.fixture(scope="session")
def pg_schemas() -> Iterator[Callable[[], str]]:
    """Makes uniquely named schemas for this test session; drops them all at the end."""
    made: list[str] = []
    prefix = f"kvl_test_{os.getpid()}_{uuid.uuid4().hex[:8]}"

    def make() -> str:
        name = f"{prefix}_{len(made)}"
        made.append(name)
        return name

    yield make
    if made:
        conn = _pg_admin()
        for name in made:
            conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')  # type: ignore[attr-defined]
        conn.close()  # type: ignore[attr-defined]


@pytest.fixture(scope="session")
def pg_available() -> None:
    """PostgreSQL must answer; a silent skip would hide that half the suite did not run."""
    if SKIP_PG:
        pytest.skip("KVLEDGER_SKIP_PG=1: PostgreSQL tests skipped on request")
    try:
        _pg_admin().close()  # type: ignore[attr-defined]
    except Exception as error:
        pytest.fail(
            f"PostgreSQL at {PG_URL} does not answer ({error}); start it (scripts/ensure_postgres.sh), "
            "set KVLEDGER_TEST_PG_URL, or set KVLEDGER_SKIP_PG=1 to skip these tests on purpose",
            pytrace=False,
        )


@pytest.fixture
def pg_url(pg_available: None, pg_schemas: Callable[[], str]) -> str:
    """A PostgreSQL store URL in a fresh schema of its own (the store creates it)."""
    return f"{PG_URL}?schema={pg_schemas()}"


@pytest.fixture(scope="session")
def nats_available() -> None:
    """The shared NATS must answer, as PostgreSQL must (scripts/ensure_nats.sh starts one where none runs)."""
    if SKIP_NATS:
        pytest.skip("KVLEDGER_SKIP_NATS=1: NATS tests skipped on request")
    host, _, port = NATS_URL.removeprefix("nats://").partition(":")
    try:
        socket.create_connection((host, int(port or 4222)), timeout=2).close()
    except OSError as error:
        pytest.fail(
            f"NATS at {NATS_URL} does not answer ({error}); start it (scripts/ensure_nats.sh), "
            "set KVLEDGER_TEST_NATS_URL, or set KVLEDGER_SKIP_NATS=1 to skip these tests on purpose",
            pytrace=False,
        )


@pytest.fixture
def nats_url(nats_available: None) -> Iterator[str]:
    """A NATS store URL naming a fresh stream (4 partitions) of its own; the stream is deleted at the end."""
    url = f"{NATS_URL}/kvl-test-{uuid.uuid4().hex[:12]}?partitions=4"
    yield url
    from kvledger.ledger.store.nats_store import NatsStore
    from kvledger.ledger.store.url import parse_url

    target = parse_url(url).nats
    assert target is not None
    with contextlib.suppress(Exception):
        leftover = NatsStore(target, create=False)
        leftover.delete_stream()
        leftover.close()


BACKENDS = [
    "memory",
    "sqlite",
    pytest.param("postgres", marks=pytest.mark.postgres),
    pytest.param("nats", marks=pytest.mark.nats),
]


ROW_BACKENDS = BACKENDS[:3]
"""The backends whose cursors are gapless row numbers and whose batches keep their order whole: what
tests/store/test_append_batch.py and test_recovery.py hold. A NATS stream's cursors have gaps and it keeps a
batch's order per (partition, source) only (ledger/store/nats_store.py), so those suites do not run on it."""


@pytest.fixture(params=BACKENDS)
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return backend_url(request, tmp_path)


def backend_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The URL of a fresh store of the backend `request.param` names."""
    if request.param == "memory":
        return "memory://"
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'ledger.db'}"
    if request.param == "nats":
        return str(request.getfixturevalue("nats_url"))
    return str(request.getfixturevalue("pg_url"))


@pytest.fixture
def store(store_url: str) -> Iterator[EventStore]:
    opened = open_store(store_url, create=True)
    yield opened
    opened.close()


def as_stored(store: EventStore, *batches: list[Event]) -> list[Event]:
    """The events of `batches` (each one append's new events) in the order `store` keeps them.

    SQL and memory stores keep each batch as it came. A NATS stream stores a batch as messages of one
    (partition, source) each, the groups in the order of their first event: that is the order a reader of
    the stream sees, and the one a partition worker folds."""
    partitions = getattr(store, "partitions", None)
    out: list[Event] = []
    for batch in batches:
        if partitions is None:
            out.extend(batch)
            continue
        groups: dict[tuple[int, str], list[Event]] = {}
        for event in batch:
            groups.setdefault((partition_of_event(event, partitions), event.source), []).append(event)
        out.extend(event for group in groups.values() for event in group)
    return out


class TcpProxy:
    """A loopback TCP proxy in front of a real server; `stop()` cuts every connection, `start()` resumes."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        self.port = probe.getsockname()[1]
        probe.close()
        self._listener: socket.socket | None = None
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()

    def start(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def stop(self) -> None:
        with self._lock:
            if self._listener is not None:
                # shutdown first: a bare close does not wake the thread blocked in accept(), which then
                # went on accepting connections through an "outage".
                with contextlib.suppress(OSError):
                    self._listener.shutdown(socket.SHUT_RDWR)
                self._listener.close()
                self._listener = None
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
            self._sockets.clear()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


@pytest.fixture
def tcp_proxy() -> Iterator[Callable[[str, int], TcpProxy]]:
    """Makes started loopback proxies to (host, port); stops them all at the end."""
    made: list[TcpProxy] = []

    def make(host: str, port: int) -> TcpProxy:
        proxy = TcpProxy((host, port))
        proxy.start()
        made.append(proxy)
        return proxy

    yield make
    for proxy in made:
        proxy.stop()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[NatsServer]:
    """A nats-server of the test's own, on a free loopback port, for tests that kill and restart it (never the
    shared one)."""
    own = NatsServer(tmp_path / "jetstream")
    own.start()
    yield own
    if own.process is not None:
        own.kill()
