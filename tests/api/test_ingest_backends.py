"""POST /events on each real backend: idempotent by (source, seq), all or nothing on a conflict, and every
stored event folded exactly once, whether ingest folds its own batch or catches up after another writer."""

from __future__ import annotations

import msgspec
from fastapi import FastAPI
from fastapi.testclient import TestClient

from kvledger.api.app import create_app
from kvledger.api.live import Live
from kvledger.ledger.events import Event, kind_of
from kvledger.ledger.fold import LedgerState
from kvledger.ledger.store.connect import open_store
from tests.api.conftest import TOKEN, settings_for
from tests.ledger.builders import Side

AUTH = {"Authorization": f"Bearer {TOKEN}"}
QUIET_POLL_S = 60.0
"""The poller's interval: longer than a test, so only ingest folds (the poller sleeps before its first poll)."""


def _app(url: str) -> FastAPI:
    return create_app(settings_for(url).model_copy(update={"poll_interval_s": QUIET_POLL_S}))


def _post(client: TestClient, events: list[Event]) -> dict[str, object]:
    response = client.post("/events", json={"events": [msgspec.to_builtins(e) for e in events]}, headers=AUTH)
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def _batch(side: Side, first: int, count: int) -> list[Event]:
    return [side.map(f"{side.source}-tx-{i}", f"r-{i}", blocks=(2 * i, 2 * i + 1)) for i in range(first, first + count)]


def _assert_folded_once(live: Live, url: str) -> None:
    """The service's state is the fold of the store, each event once, up to the store's last cursor."""
    store = open_store(url)
    try:
        rows = store.tail(0, 10_000)
    finally:
        store.close()
    expected = LedgerState()
    kinds: dict[str, int] = dict.fromkeys(live.events_by_kind, 0)
    for _, event in rows:
        expected.apply(event)
        kinds[kind_of(event)] += 1
    assert live.cursor == rows[-1][0]
    assert live.events_by_kind == kinds
    assert sorted(live.state.transfers) == sorted(expected.transfers)
    assert live.state.held == expected.held


def test_ingest_is_idempotent_and_all_or_nothing(store_url: str) -> None:
    side = Side("remote/tp0")
    batch = _batch(side, 0, 20)
    with TestClient(_app(store_url)) as client:
        first = _post(client, batch)
        assert (first["inserted"], first["duplicates"], first["gaps"]) == (20, 0, [])
        again = _post(client, batch)
        assert (again["inserted"], again["duplicates"], again["cursor"]) == (0, 20, first["cursor"])
        more = _batch(side, 20, 5)
        mixed = _post(client, [*batch[15:], *more])
        assert (mixed["inserted"], mixed["duplicates"]) == (5, 5)
        changed = msgspec.structs.replace(batch[3], request_id="someone-else")
        refused = client.post(
            "/events",
            json={"events": [msgspec.to_builtins(e) for e in [*_batch(Side("remote/tp1"), 0, 3), changed]]},
            headers=AUTH,
        )
        assert refused.status_code == 409
        assert "'remote/tp0' seq 4" in refused.json()["detail"][0]["msg"]
        _assert_folded_once(client.app.state.live, store_url)  # type: ignore[attr-defined]
        assert client.app.state.live.cursor == mixed["cursor"]  # type: ignore[attr-defined]


def test_events_another_writer_stored_between_ingests_are_folded_once(store_url: str) -> None:
    ours, theirs = Side("remote/tp0"), Side("local/tp0")
    with TestClient(_app(store_url)) as client:
        _post(client, _batch(ours, 0, 10))
        other = open_store(store_url)
        try:
            other.append(_batch(theirs, 0, 7))  # not folded yet: the poller is asleep
        finally:
            other.close()
        second = _post(client, _batch(ours, 10, 10))
        assert second["inserted"] == 10
        _assert_folded_once(client.app.state.live, store_url)  # type: ignore[attr-defined]
        _post(client, _batch(ours, 20, 10))  # right after what was folded: from the batch itself
        _assert_folded_once(client.app.state.live, store_url)  # type: ignore[attr-defined]
