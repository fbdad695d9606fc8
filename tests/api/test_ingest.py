"""POST /events: token checks, idempotency by (source, seq), per-source order, gaps, and bad bodies as 4xx."""

from __future__ import annotations

import gc
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import msgspec
import pytest
from fastapi.testclient import TestClient

from kvledger.api import snapshots
from kvledger.api.app import create_app
from kvledger.ledger.events import Ack, Event, Expire, Fail, Map, ReqId, TransferId
from kvledger.ledger.store.connect import open_store
from tests.api.conftest import TOKEN, settings_for, wait_for
from tests.ledger.builders import Side

AUTH = {"Authorization": f"Bearer {TOKEN}"}


def body(events: list[Event]) -> dict[str, object]:
    return {"events": [msgspec.to_builtins(e) for e in events]}


def stored(url: str) -> int:
    store = open_store(url)
    try:
        return store.count()
    finally:
        store.close()


@pytest.fixture
def empty(sqlite_url: str) -> TestClient:
    with TestClient(create_app(settings_for(sqlite_url))) as test_client:
        yield test_client  # type: ignore[misc]


@pytest.mark.parametrize(
    ("headers", "status"),
    [({}, 401), ({"Authorization": "Bearer wrong"}, 403), ({"Authorization": "Basic abc"}, 401)],
)
def test_ingest_needs_the_right_token(empty: TestClient, sqlite_url: str, headers: dict[str, str], status: int) -> None:
    side = Side("remote/tp0")
    response = empty.post("/events", json=body([side.map("tx-1", "r-1")]), headers=headers)
    assert response.status_code == status
    assert stored(sqlite_url) == 0


def test_ingest_is_refused_when_no_token_is_configured(sqlite_url: str) -> None:
    settings = settings_for(sqlite_url).model_copy(update={"token": None})
    with TestClient(create_app(settings)) as test_client:
        response = test_client.post("/events", json=body([Side("a").map("t", "r")]), headers=AUTH)
    assert response.status_code == 403 and "no token" in response.json()["detail"]


def test_ingest_folds_at_once_and_is_idempotent(empty: TestClient, sqlite_url: str) -> None:
    side = Side("remote/tp0")
    batch = [side.map("tx-1", "r-1"), side.ack("tx-1", "release")]
    first = empty.post("/events", json=body(batch), headers=AUTH).json()
    assert (first["inserted"], first["duplicates"], first["gaps"], first["cursor"]) == (2, 0, [], 2)
    assert empty.get("/transfers/tx-1").json()["sides"][0]["phase"] == "completed"
    again = empty.post("/events", json=body(batch), headers=AUTH).json()
    assert (again["inserted"], again["duplicates"], again["cursor"]) == (0, 2, 2)
    assert stored(sqlite_url) == 2
    assert empty.get("/metrics").text.count('kvledger_events_total{kind="map"} 1.0') == 1


def test_what_ingest_grows_is_kept_out_of_the_collector_batch_after_batch(empty: TestClient) -> None:
    """The fold's grown containers, the request index and the cursor order are untracked after every
    batch's fold (kvledger.ledger.collector): sets, lists and deques are always tracked and a dict is tracked again
    by a fresh key tuple, and a sustained ingest then spent a third of its CPU walking them."""
    live = empty.app.state.live  # type: ignore[attr-defined]
    side = Side("remote/tp0")
    for batch in range(3):
        events = [side.map(f"tx-{batch}-{i}", f"r-{batch}-{i}", blocks=(10 * batch + i,)) for i in range(10)]
        assert empty.post("/events", json=body(events), headers=AUTH).json()["inserted"] == 10
        grown = [*live.state.grown_containers(), live.order, live.by_request]
        assert len(live.state.held["remote/tp0"]) == 10 * (batch + 1)
        assert [type(c).__name__ for c in grown if gc.is_tracked(c)] == []


def test_ingest_reports_gaps_per_source(empty: TestClient) -> None:
    side = Side("remote/tp0")
    events = [side.map(f"tx-{i}", f"r-{i}") for i in range(5)]
    result = empty.post("/events", json=body([events[0], events[3]]), headers=AUTH).json()
    assert result["gaps"] == [{"source": "remote/tp0", "missing_from": 2, "missing_to": 3}]
    filled = empty.post("/events", json=body([events[1], events[2], events[4]]), headers=AUTH).json()
    assert filled["inserted"] == 3 and filled["gaps"] == []


def test_conflicting_content_is_409_and_writes_nothing(empty: TestClient, sqlite_url: str) -> None:
    side = Side("remote/tp0")
    first = side.map("tx-1", "r-1")
    assert empty.post("/events", json=body([first]), headers=AUTH).status_code == 200
    other = msgspec.structs.replace(first, request_id="someone-else")
    fresh = Side("remote/tp1").map("tx-2", "r-2")
    response = empty.post("/events", json=body([fresh, other]), headers=AUTH)
    assert response.status_code == 409
    assert stored(sqlite_url) == 1


def test_out_of_order_batch_is_rejected(empty: TestClient, sqlite_url: str) -> None:
    side = Side("remote/tp0")
    a, b = side.map("tx-1", "r-1"), side.map("tx-2", "r-2")
    response = empty.post("/events", json=body([b, a]), headers=AUTH)
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["body", "events", 1, "seq"]
    assert stored(sqlite_url) == 0


@pytest.mark.parametrize(
    ("order", "bad_index"),
    [
        ([("a", 1), ("b", 2), ("a", 2), ("b", 1)], 3),  # b goes back while a rises
        ([("a", 1), ("b", 1), ("a", 1)], 2),  # a repeats, b in between
        ([("b", 5), ("a", 1), ("a", 3), ("b", 6), ("a", 2), ("b", 4)], 4),  # the first of two is named
    ],
)
def test_an_out_of_order_source_among_several_is_named(
    empty: TestClient, sqlite_url: str, order: list[tuple[str, int]], bad_index: int
) -> None:
    events = [Side(f"remote-{source}/tp0").map(f"tx-{source}-{seq}", "r") for source, seq in order]
    events = [msgspec.structs.replace(e, seq=seq) for e, (_, seq) in zip(events, order, strict=True)]
    response = empty.post("/events", json=body(events), headers=AUTH)
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["body", "events", bad_index, "seq"]
    assert stored(sqlite_url) == 0


def test_interleaved_sources_each_rising_are_taken(empty: TestClient) -> None:
    a, b = Side("remote-a/tp0"), Side("remote-b/tp0")
    events = [a.map("tx-1", "r-1"), b.map("tx-2", "r-2"), b.ack("tx-2", "release"), a.ack("tx-1", "release")]
    result = empty.post("/events", json=body(events), headers=AUTH).json()
    assert (result["inserted"], result["gaps"]) == (4, [])


def _valid_map() -> dict[str, object]:
    return msgspec.to_builtins(Side("remote/tp0").map("tx-1", "r-1"))  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("raw", "loc_suffix"),
    [
        (b"{not json", []),
        (b'{"events": 3}', ["events"]),
        (json.dumps({"events": [_valid_map() | {"kind": "teleport"}]}).encode(), ["events", 0, "kind"]),
        (json.dumps({"events": [_valid_map() | {"block_ids": "1,2"}]}).encode(), ["events", 0, "block_ids"]),
        (json.dumps({"events": [_valid_map() | {"seq": 0}]}).encode(), ["events", 0, "seq"]),
        (json.dumps({"events": [_valid_map() | {"ts": 1e300}]}).encode(), ["events", 0, "ts"]),
        (json.dumps({"events": [_valid_map() | {"acks_expected": 0}]}).encode(), ["events", 0]),
        (json.dumps({"events": [_valid_map() | {"source": "x" * 500}]}).encode(), ["events", 0, "source"]),
        (json.dumps({"events": [_valid_map() | {"seq": 1 << 70}]}).encode(), ["events", 0, "seq"]),
        (json.dumps({"events": [_valid_map() | {"block_ids": [1, 1 << 64]}]}).encode(), ["events", 0, "block_ids"]),
        (json.dumps({"events": [_valid_map() | {"ts": 9e11}]}).encode(), ["events", 0, "ts"]),
        (json.dumps({"events": [_valid_map() | {"deadline": -1.0}]}).encode(), ["events", 0, "deadline"]),
        (json.dumps({"events": [_valid_map() | {"request_id": "r\x00"}]}).encode(), ["events", 0, "request_id"]),
        (json.dumps({"events": [_valid_map() | {"transfer_id": ""}]}).encode(), ["events", 0, "transfer_id"]),
        (json.dumps({"events": [], "extra": 1}).encode(), []),
    ],
)
def test_bad_bodies_are_422_naming_the_field(
    empty: TestClient, sqlite_url: str, raw: bytes, loc_suffix: list[object]
) -> None:
    response = empty.post("/events", content=raw, headers=AUTH | {"Content-Type": "application/json"})
    assert response.status_code == 422, response.text
    detail = response.json()["detail"][0]
    assert detail["loc"][: 1 + len(loc_suffix)] == ["body", *loc_suffix] and detail["msg"]
    assert stored(sqlite_url) == 0


def test_an_escaped_backslash_before_u0000_is_text_not_a_nul(empty: TestClient, sqlite_url: str) -> None:
    """The JSON string "C:\\\\u0000" is a backslash followed by `u0000`, six plain characters."""
    event = Side("remote/tp0").map("tx-1", "C:\\u0000")
    raw = json.dumps(body([event])).encode()
    assert b"\\\\u0000" in raw
    response = empty.post("/events", content=raw, headers=AUTH | {"Content-Type": "application/json"})
    assert response.status_code == 200, response.text
    assert empty.get("/requests/C:\\u0000").json()["sides"][0]["transfer_id"] == "tx-1"


def test_oversized_body_is_413(sqlite_url: str) -> None:
    settings = settings_for(sqlite_url, ingest_body_bytes_max=2048)
    with TestClient(create_app(settings)) as test_client:
        response = test_client.post("/events", content=b"x" * 4096, headers=AUTH)
    assert response.status_code == 413 and "limit" in response.json()["detail"][0]["msg"]


def test_too_many_events_is_422(sqlite_url: str) -> None:
    side = Side("remote/tp0")
    with TestClient(create_app(settings_for(sqlite_url, ingest_events_max=2))) as test_client:
        response = test_client.post("/events", json=body([side.map(f"t{i}", "r") for i in range(3)]), headers=AUTH)
    assert response.status_code == 422 and response.json()["detail"][0]["loc"] == ["body", "events"]


@pytest.mark.parametrize(
    "query",
    ["/transfers?limit=0", "/transfers?limit=5000", "/transfers?phase=gone", "/transfers?cursor=-1",
     "/audit?now=yesterday", "/audit?code=nope", "/events?after_seq=x", "/transfers?has_finding=maybe"],
)  # fmt: skip
def test_bad_query_values_are_422(empty: TestClient, query: str) -> None:
    response = empty.get(query)
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"][0] == "query"


def test_metrics_count_lease_renewals_expiries_and_refused_reads(empty: TestClient) -> None:
    tid, p, c = TransferId("tx-lease"), "prefill-0/tp0", "decode-0/tp0"
    events: list[Event] = [
        Map(seq=1, ts=1.0, source=p, transfer_id=tid, request_id=ReqId("p"), role="producer", mode="read",
            block_ids=(1,), deadline=5.0),
        Ack(seq=2, ts=2.0, source=p, transfer_id=tid, what="lease", until=9.0),
        Expire(seq=3, ts=9.0, source=p, transfer_id=tid, deadline="defer"),
        Map(seq=1, ts=1.0, source=c, transfer_id=tid, request_id=ReqId("c"), role="consumer", mode="read",
            block_ids=(2,), deadline=50.0),
        Fail(seq=2, ts=10.0, source=c, transfer_id=tid, reason="read_refused: released", code="read_refused"),
    ]  # fmt: skip
    assert empty.post("/events", json=body(events), headers=AUTH).status_code == 200
    text = empty.get("/metrics").text
    for what in ("renewals", "expiries", "reads_refused"):
        assert f'kvledger_leases_total{{what="{what}"}} 1.0' in text


def test_concurrent_ingests_fold_every_stored_event_once_in_cursor_order(sqlite_url: str) -> None:
    """Batches posted at once from several sources: a batch folds outside the append's lock, so another's
    append may land first; the fold must still take each stored event once, in cursor order, and equal a
    fold of the store from its start."""
    sources = [Side(f"remote-{s}/tp0") for s in range(4)]
    batches = [
        [side.map(f"tx-{s}-{b}-{i}", f"r-{s}-{b}-{i}") for i in range(25)]
        for s, side in enumerate(sources)
        for b in range(6)
    ]
    app = create_app(settings_for(sqlite_url, snapshot_every_events=0))
    with TestClient(app) as client, ThreadPoolExecutor(len(sources)) as pool:
        answers = list(pool.map(lambda batch: client.post("/events", json=body(batch), headers=AUTH), batches))
        assert all(a.status_code == 200 and a.json()["inserted"] == 25 for a in answers)
        live = app.state.live
        wait_for(lambda: live.rows_folded == 25 * len(batches))
        assert sum(live.events_by_kind.values()) == live.rows_folded == stored(sqlite_url)
        folded = snapshots.encode(live)[2]
    with TestClient(create_app(settings_for(sqlite_url, snapshot_every_events=0, snapshots_read=False))) as again:
        assert snapshots.encode(again.app.state.live)[2] == folded  # type: ignore[attr-defined]


def test_concurrent_ingests_append_one_at_a_time_on_the_ingest_thread(sqlite_url: str) -> None:
    """The appends of batches posted at once run one after another (the store's write lock would make any
    other wait on a store thread), on the ingest thread, each queued as its batch was decoded; the thread
    ends with the service."""
    running: list[str] = []
    seen: list[tuple[str, int]] = []
    app = create_app(settings_for(sqlite_url, snapshot_every_events=0))
    with TestClient(app) as client, ThreadPoolExecutor(4) as pool:
        live = app.state.live
        store = live.store
        append = store.append_returning

        def watched(events: list[Event], *, checked: bool = False) -> object:
            running.append(threading.current_thread().name)
            seen.append((running[-1], len(running)))
            try:
                return append(events, checked=checked)
            finally:
                running.pop()

        store.append_returning = watched
        sides = [Side(f"remote-{s}/tp0") for s in range(4)]
        batches = [
            [side.map(f"tx-{s}-{b}-{i}", f"r-{s}-{b}-{i}") for i in range(20)]
            for s, side in enumerate(sides)
            for b in range(5)
        ]
        answers = list(pool.map(lambda batch: client.post("/events", json=body(batch), headers=AUTH), batches))
        assert all(a.status_code == 200 and a.json()["inserted"] == 20 for a in answers)
        wait_for(lambda: live.rows_folded == 20 * len(batches))
        appender = live.appender
    assert len(seen) == len(batches)
    assert all(name.startswith("kvledger-ingest") and depth == 1 for name, depth in seen), seen
    with pytest.raises(RuntimeError, match="shutdown"):
        appender.submit(print)  # closed with the service: no thread left behind
