"""Through real HTTP on loopback (uvicorn in a thread) over real SQLite and PostgreSQL: ingest, poll, stream."""

from __future__ import annotations

import json
from collections.abc import Iterator

import msgspec
import pytest

from kvledger.ledger.events import Event
from kvledger.ledger.store.base import StoreUnavailable
from kvledger.ledger.store.connect import open_store
from kvledger.ledger.store.sql import SqlStore
from tests.api.conftest import TOKEN, http, wait_for
from tests.api.seed import AUDIT_NOW
from tests.ledger.builders import Side


def test_read_side_over_http(served: tuple[str, str]) -> None:
    base, _ = served
    with http(base) as client:
        assert client.get("/readyz").json()["ready"] is True
        audit = client.get("/audit", params={"now": AUDIT_NOW}).json()
        assert [f["code"] for f in audit["findings"]] == ["leak", "late_event"]
        assert len(client.get("/transfers/tx-ok").json()["timeline"]) == 5


def test_ingest_over_http_is_folded_and_idempotent(served: tuple[str, str]) -> None:
    base, _ = served
    side = Side("remote/tp0")
    events = [side.map(f"tx-r{i}", f"r-{i}") for i in range(1000)]
    payload = {"events": [msgspec.to_builtins(e) for e in events]}
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with http(base) as client:
        assert client.post("/events", json=payload).status_code == 401
        first = client.post("/events", json=payload, headers=auth).json()
        assert (first["inserted"], first["cursor"]) == (1000, 1009)
        assert client.post("/events", json=payload, headers=auth).json()["duplicates"] == 1000
        live = client.get("/transfers", params={"source": "remote/tp0", "limit": 1000}).json()["transfers"]
        assert len(live) == 1000 and all(t["phase"] == "held" for t in live)


def test_poller_folds_events_another_writer_appended(served: tuple[str, str]) -> None:
    base, store_url = served
    side = Side("elsewhere/tp3")
    store = open_store(store_url)
    try:
        store.append([side.map("tx-ext", "r-ext"), side.ack("tx-ext", "release")])
    finally:
        store.close()
    with http(base) as client:
        wait_for(lambda: client.get("/readyz").json()["cursor"] == 11)
        sides = client.get("/transfers/tx-ext").json()["sides"]
        assert [s["phase"] for s in sides] == ["completed"]


def test_event_stream_follows_and_ends_when_the_client_goes(served: tuple[str, str]) -> None:
    base, store_url = served
    with http(base) as client, client.stream("GET", "/events/stream", params={"after_seq": 7}) as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        received = _streamed_through_a_late_map(store_url, stream.iter_lines())
    assert [e["kind"] for e in received] == ["expire", "ack", "map"]
    with http(base) as client:
        # The server notices the closed connection and ends the stream: nothing is left open.
        wait_for(lambda: "kvledger_streams_open 0.0" in client.get("/metrics").text)


def test_an_event_stream_outlives_a_store_read_that_failed(
    served: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stream's first read of the store fails: the stream says so in a comment and reads again from the
    same cursor once the fold moves, never ending nor skipping an event."""
    base, store_url = served
    failed: list[int] = []
    real_tail = SqlStore.tail

    def failing_once(self: SqlStore, after_cursor: int = 0, limit: int = 1000) -> list[tuple[int, Event]]:
        if after_cursor == 7 and not failed:
            failed.append(after_cursor)
            raise StoreUnavailable("the store went away for one read")
        return real_tail(self, after_cursor, limit)

    monkeypatch.setattr(SqlStore, "tail", failing_once)
    with http(base) as client, client.stream("GET", "/events/stream", params={"after_seq": 7}) as stream:
        lines = stream.iter_lines()
        comment = next(line for line in lines if line.startswith(":"))
        received = _streamed_through_a_late_map(store_url, lines)
    assert failed == [7] and comment == ": the store did not answer: StoreUnavailable"
    assert [e["kind"] for e in received] == ["expire", "ack", "map"]


def _streamed_through_a_late_map(store_url: str, lines: Iterator[str]) -> list[dict[str, object]]:
    """A map appended to the store (folded: the stream wakes); the events `lines` streamed, through it."""
    store = open_store(store_url)
    try:
        store.append([Side("late/tp0").map("tx-stream", "r-s")])
    finally:
        store.close()
    received: list[dict[str, object]] = []
    for line in lines:
        if line.startswith("data: "):
            received.append(json.loads(line[len("data: ") :]))
            if received[-1]["transfer_id"] == "tx-stream":
                break
    return received
