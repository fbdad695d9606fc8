"""No stored event and no odd request stops the service: the poison pill of issue 14 folds as evidence,
a fold error (should the fold ever raise) is counted and passed over, odd ids and times are 4xx, the
store's quarantine is shown, and an event stored before the validity rules still renders."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import msgspec
import pytest
from fastapi.testclient import TestClient

from kvledger.api.app import create_app
from kvledger.ledger.events import Event, to_msgpack
from kvledger.ledger.fold import LedgerState
from kvledger.ledger.store.connect import open_store
from tests.api.conftest import TOKEN, settings_for, wait_for
from tests.ledger.builders import Side, apply_raising_on


def _store(url: str, events: list[Event]) -> None:
    store = open_store(url)
    try:
        store.append(events)
    finally:
        store.close()


def _poison() -> list[Event]:
    p = Side("prefill-0/tp0")
    maps = [p.map("a", "ra", blocks=(2, 2)), p.map("b", "rb", blocks=(2,)), p.map("c", "rc", blocks=(2,))]
    return [*maps, p.expire("a")]


def test_the_service_starts_on_a_store_holding_the_poison_pill(sqlite_url: str) -> None:
    """Once, this store made `kvledger serve` fail at start, and ingesting its last event was a 500."""
    _store(sqlite_url, _poison())
    with TestClient(create_app(settings_for(sqlite_url))) as client:
        sides = client.get("/transfers/a").json()["sides"]
        assert [s["phase"] for s in sides] == ["expired"]
        assert "duplicate" in client.get("/audit", params={"now": 1001}).json()["counts"]
        assert "kvledger_fold_errors_total 0.0" in client.get("/metrics").text


def test_ingesting_the_poison_pill_is_200_and_folds_it_whole(sqlite_url: str) -> None:
    """Once a 500 with the live state half-applied."""
    body = {"events": [msgspec.to_builtins(e) for e in _poison()]}
    with TestClient(create_app(settings_for(sqlite_url))) as client:
        answer = client.post("/events", json=body, headers={"Authorization": f"Bearer {TOKEN}"})
        assert answer.status_code == 200 and answer.json()["inserted"] == 4
        assert [s["phase"] for s in client.get("/transfers/a").json()["sides"]] == ["expired"]
        assert [s["phase"] for s in client.get("/transfers/b").json()["sides"]] == ["held"]


def test_a_fold_error_is_counted_and_passed_over(sqlite_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fold never raises (tests/fuzz); should it ever, the live service passes over that one event."""
    p = Side("prefill-0/tp0")
    with TestClient(create_app(settings_for(sqlite_url))) as client:
        live = client.app.state.live  # type: ignore[attr-defined]
        monkeypatch.setattr(LedgerState, "apply", apply_raising_on("boom"))
        _store(sqlite_url, [p.map("before", "r1"), p.map("boom", "r2"), p.map("after", "r3")])
        wait_for(lambda: live.cursor == 3)
        assert live.fold_errors == 1
        assert {s["transfer_id"] for s in client.get("/transfers").json()["transfers"]} == {"before", "after"}
        assert "kvledger_fold_errors_total 1.0" in client.get("/metrics").text


@pytest.mark.parametrize(
    "path",
    ["/?now=9e11", "/audit?now=9e11", "/audit/summary?now=1e300", "/transfers?now=-1", "/transfers/%00",
     "/ui/transfers/%00", "/transfers/" + "t" * 201],
)  # fmt: skip
def test_odd_ids_and_times_are_4xx_never_5xx(store_url: str, path: str) -> None:
    """Once, `/?now=9e11` was 500 (no calendar prints it) and `/transfers/%00` 503 on PostgreSQL."""
    with TestClient(create_app(settings_for(store_url))) as client:
        answer = client.get(path)
    assert answer.status_code == 422, answer.text


def test_the_quarantine_is_shown(sqlite_url: str) -> None:
    event = Side("prefill-0/tp0").map("t" * 300, "r")
    store = open_store(sqlite_url)
    store.quarantine([(event, "UnstorableEvent: field 'transfer_id': longer than 200 characters")])
    store.close()
    with TestClient(create_app(settings_for(sqlite_url))) as client:
        shown = client.get("/quarantine").json()
        assert shown["total"] == 1 and "longer than 200" in shown["events"][0]["reason"]
        assert msgspec.json.decode(shown["events"][0]["event"])["transfer_id"] == "t" * 300
        assert "kvledger_quarantined_events 1.0" in client.get("/metrics").text
        page = client.get("/").text
        assert "1 events were quarantined" in page and "nothing leaked" not in page  # no all-clear over it


def test_an_event_stored_before_the_rules_still_renders(sqlite_url: str, tmp_path: Path) -> None:
    """A time no calendar prints, written by an older kvledger (ingest took ts up to 1e12): the timeline
    page and the JSON answer 200, never 500."""
    event = Side("prefill-0/tp0").map("tx-far", "r", ts=9e11, deadline=9e11 + 60)
    with sqlite3.connect(sqlite_url.removeprefix("sqlite:///")) as conn:
        conn.execute(
            "INSERT INTO events (source, seq, ts, kind, transfer_id, body) VALUES (?, ?, ?, ?, ?, ?)",
            (event.source, event.seq, event.ts, "map", event.transfer_id, to_msgpack(event)),
        )
    with TestClient(create_app(settings_for(sqlite_url))) as client:
        assert client.get("/transfers/tx-far").status_code == 200
        page = client.get("/ui/transfers/tx-far")
        assert page.status_code == 200 and "900000000000.000 s" in page.text
        assert client.get("/").status_code == 200
