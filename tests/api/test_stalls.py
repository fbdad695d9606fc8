"""No client and no store stall holds the service: real uvicorn on loopback, configured as `kvledger serve`.

A half-sent header, a trickled body, a header too large, too many connections, stalled replay
uploads, a client that goes away mid-body, and (PostgreSQL) a lock on the events table held by
another session: each is answered or cut off within a bound, and what is served from memory
keeps answering. No assertion here is about time: a stall shows up as a socket or client
timeout, which fails the test.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from kvledger.api.app import create_app
from tests.api.conftest import ServerThread, http, seed, settings_for, wait_for
from tests.store.test_stalls import table_locked

STALLED_CALLS = 45
"""Store calls stuck behind a lock at once: more than the 40 threads of the pool FastAPI shares."""

SOCKET_TIMEOUT_S = 30.0
"""A test socket gives up after this long: only ever reached when the service failed to cut a stall."""


def _port(base: str) -> int:
    return int(base.rsplit(":", 1)[1])


def _connect(base: str) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", _port(base)), timeout=SOCKET_TIMEOUT_S)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


@pytest.fixture
def served_with(seeded_url: str) -> Iterator[object]:
    """Start a real server over the seeded SQLite store with some settings changed."""
    servers: list[ServerThread] = []

    def start(**overrides: object) -> str:
        server = ServerThread(create_app(settings_for(seeded_url, **overrides)))
        servers.append(server)
        return server.__enter__()

    yield start
    for server in servers:
        server.__exit__(None, None, None)


def test_a_half_sent_header_and_a_silent_client_are_cut_off(served_with: object) -> None:
    base = served_with(header_timeout_s=0.3)  # type: ignore[operator]
    silent, half = _connect(base), _connect(base)
    half.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    assert _read_all(silent) == b"" and _read_all(half) == b""  # closed by the server, nothing answered
    with http(base) as client:  # and a kept-alive client that sends its next request is fine
        assert client.get("/healthz").status_code == 200 and client.get("/healthz").status_code == 200


def test_a_header_too_large_is_refused(served_with: object) -> None:
    """A 64 MiB header was once read to its end; now the server stops reading and answers 400."""
    base = served_with(header_bytes_max=8192)  # type: ignore[operator]
    sock = _connect(base)
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: ")
    with pytest.raises(OSError):  # the server answers and closes while the rest is still being sent
        for _ in range(64):
            sock.sendall(b"a" * (1 << 20))
    assert _read_all(sock).startswith(b"HTTP/1.1 400 ")


@pytest.mark.parametrize("path", ["/events", "/replay"])
def test_a_trickled_body_gets_408_and_the_connection_closes(served_with: object, path: str) -> None:
    base = served_with(body_timeout_s=0.3)  # type: ignore[operator]
    sock = _connect(base)
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer test-token-not-secret\r\n"
        'Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"events": ['.encode()
    )
    answer = _read_all(sock)  # read to the close: the server ends the connection after answering
    assert answer.startswith(b"HTTP/1.1 408 ") and b"connection: close" in answer.lower()
    assert b"did not arrive within" in answer


def test_connections_beyond_the_limit_get_503(served_with: object) -> None:
    base = served_with(connections_max=3)  # type: ignore[operator]
    idle = [_connect(base) for _ in range(3)]
    with http(base) as client:
        assert client.get("/healthz").status_code == 503
    for sock in idle:
        sock.close()
    with http(base) as client:
        wait_for(lambda: client.get("/healthz").status_code == 200)


def test_stalled_uploads_do_not_take_the_replay_slots(served_with: object) -> None:
    """Two stalled uploads without a token once took every replay slot, for as long as they liked."""
    base = served_with(replays_at_once_max=1)  # type: ignore[operator]
    stalled = [_connect(base) for _ in range(2)]
    for sock in stalled:
        sock.sendall(b'POST /replay HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n{"format":')
    with http(base) as client:
        wait_for(lambda: "kvledger_replay_uploads_reading 2.0" in client.get("/metrics").text)
        log = b'{"format":"kvledger","version":1}\n'
        answer = client.post("/replay", content=log)
    assert answer.status_code == 200 and answer.json()["events"] == 0
    for sock in stalled:
        sock.close()


def test_a_client_leaving_mid_body_is_logged_at_debug_not_as_an_error(
    served_with: object, caplog: pytest.LogCaptureFixture
) -> None:
    base = served_with()  # type: ignore[operator]
    caplog.set_level(logging.DEBUG, logger="kvledger.api.errors")
    sock = _connect(base)
    sock.sendall(
        b"POST /events HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer test-token-not-secret\r\n"
        b'Content-Length: 1000\r\n\r\n{"events": ['
    )
    sock.close()
    wait_for(lambda: any("went away" in r.getMessage() for r in caplog.records))
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


@pytest.mark.postgres
def test_a_locked_store_answers_not_ready_and_never_starves_what_memory_serves(pg_url: str) -> None:
    """An ACCESS EXCLUSIVE lock once made /readyz answer 200 after 8 s and hung /transfers and /audit."""
    seed(pg_url)
    schema = pg_url.rsplit("schema=", 1)[1]
    # Store calls wait on the lock for longer than a test client waits for an answer: a starved endpoint
    # shows up as the client's timeout.
    url = pg_url + "&options=-c%20lock_timeout%3D90000%20-c%20statement_timeout%3D90000"
    settings = settings_for(url, store_threads_max=2, ready_timeout_s=0.5)
    with ServerThread(create_app(settings)) as base, http(base) as client:
        client.get("/readyz").raise_for_status()
        pool = ThreadPoolExecutor(STALLED_CALLS)
        started = threading.Barrier(STALLED_CALLS + 1)

        def tail() -> httpx.Response:
            started.wait()
            with http(base) as own:
                return own.get("/events", params={"limit": 5})

        with table_locked(schema):
            futures = [pool.submit(tail) for _ in range(STALLED_CALLS)]
            started.wait()
            # Store calls now wait on the lock (two threads) or for one of those threads (the rest), more
            # of them than the shared thread pool has threads: what memory serves still answers.
            ready = client.get("/readyz")
            assert ready.status_code == 503 and "did not answer within 0.5 s" in ready.json()["error"]
            assert client.get("/transfers").status_code == 200
            assert client.get("/audit", params={"now": 2000}).json()["total"] == 2
            assert client.get("/healthz").status_code == 200 and client.get("/metrics").status_code == 200
            assert not any(f.done() for f in futures)  # the lock is still held: these are still waiting
        # The lock released, each store call finishes.
        assert [f.result().status_code for f in futures] == [200] * STALLED_CALLS
        pool.shutdown()
        wait_for(lambda: client.get("/readyz").status_code == 200)


@pytest.mark.postgres
def test_a_store_call_behind_a_lock_fails_as_503_not_a_hang(pg_url: str) -> None:
    seed(pg_url)
    schema = pg_url.rsplit("schema=", 1)[1]
    url = pg_url + "&options=-c%20lock_timeout%3D300"
    with ServerThread(create_app(settings_for(url))) as base, http(base) as client, table_locked(schema):
        answer = client.post("/events", json={"events": []}, headers={"Authorization": "Bearer test-token-not-secret"})
        assert answer.status_code == 503 and "lock timeout" in answer.json()["detail"]
