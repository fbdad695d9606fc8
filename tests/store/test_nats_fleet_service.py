"""`kvledger serve --db nats://... --partitions` as a real process over a stream on the loopback NATS: four
partition workers folding a history's stream answer /audit, /transfers and /transfers/{id} as one fold of
the whole stream does, and /audit/summary and the fold's metrics as the one-process service over the stream
does; two services splitting the partitions (0-1 and 2-3) merge, through their /fleet/answers, into the
same answer."""

from __future__ import annotations

import json
import os
import re
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvledger.api.fleet import merge_services
from kvledger.api.views import finding_out
from kvledger.ledger.events import Event, Map
from kvledger.ledger.fleet import through_cursor
from kvledger.ledger.merge import batched
from kvledger.ledger.store.connect import open_store
from kvledger.ledger.store.nats_store import NatsStore
from tests.api.conftest import TOKEN, http, wait_for
from tests.ledger.builders import Side
from tests.ledger.histories import Shape, history
from tests.store.fleet_service import POLLS_MAX, FleetService, first_seen, get_json, one_fold_findings

pytestmark = pytest.mark.nats

SHAPE = Shape(transfers=80, span_s=200.0, block_pool=8, reuse_rate=0.2, orphan_rate=0.1,
              consumers=("decode-0/tp0", "decode-1/tp0"))  # fmt: skip


@pytest.fixture
def stream(nats_url: str) -> Iterator[tuple[str, list[Event], int]]:
    """The history appended to a fresh 4-partition stream: (url, events as stored, last stream sequence)."""
    store = open_store(nats_url, create=True)
    assert isinstance(store, NatsStore)
    for batch in batched(history(5, SHAPE), 40):
        store.append(batch)
    stored = list(store.read())
    last_seq = store.last_sequence()
    store.close()
    yield nats_url, stored, last_seq


def _same_summary_and_metrics(fleet: FleetService, one: FleetService, stored: list[Event], now: float) -> None:
    """`/audit/summary` and the metrics that derive from the fold: the service over partition workers (folded
    through the stream's end) says what the one-process service over the same stream says."""
    for _ in range(POLLS_MAX):
        try:
            if sum(v for (name, _), v in one.metrics().items() if name == "kvledger_events_total") == len(stored):
                break
        except OSError:
            pass  # not up yet
        time.sleep(0.01)
    caught_up = time.time()
    summary = one.get(f"/audit/summary?now={now!r}")
    assert summary["findings_total"] > 0 and summary["lost_sources"] and summary["oldest_held"] is not None
    assert summary["ack_latency_s"]["p99"] is not None and summary["blocks_lost"] > 0
    assert fleet.get(f"/audit/summary?now={now!r}") == summary
    later = now + 3600.0  # every source that holds blocks is lost by then: no oldest on a live engine
    assert fleet.get(f"/audit/summary?now={later!r}") == one.get(f"/audit/summary?now={later!r}")
    # /requests/{id}: the sides maps named each request for, in the order they first named them.
    named: dict[str, set[tuple[str, str]]] = {}
    for e in stored:
        if type(e) is Map:
            named.setdefault(e.request_id, set()).add((e.source, e.transfer_id))
    assert len(named) > 100
    for request_id in named:
        assert fleet.get(f"/requests/{request_id}") == one.get(f"/requests/{request_id}")
    # The page's findings-over-time plot: each finding at the time it became true, a `double_owner` the merge
    # judged at its side's time (asked of the worker folding the side).
    plots = [_findings_plot(service, now) for service in (fleet, one)]
    assert plots[0] == plots[1] and "findings" in plots[1]
    for service in (fleet, one):
        with pytest.raises(urllib.error.HTTPError) as unnamed:
            get_json(service.base, "/requests/no-such-request")
        assert unnamed.value.code == 404
    for service in (fleet, one):
        service.published_after(caught_up)
    metrics = one.metrics()
    assert {name for name, _ in metrics} >= {f"{m}_total" for m in ("kvledger_events", "kvledger_releases")}
    assert sum(v for (name, _), v in metrics.items() if name == "kvledger_findings") > 0
    assert fleet.metrics() == metrics


def _findings_plot(service: FleetService, now: float) -> str:
    with urllib.request.urlopen(f"{service.base}/?now={now!r}", timeout=30) as response:
        found = re.search(r'<svg[^>]*id="plot-findings".*?</svg>', response.read().decode(), re.S)
    assert found is not None, "the page draws the findings over time"
    return found.group(0)


def _problems(service: FleetService) -> list[str]:
    with urllib.request.urlopen(f"{service.base}/", timeout=30) as response:
        return re.findall(r'<div class="problem" data-kind="(\w+)">', response.read().decode())


def _ready(service: FleetService) -> tuple[int, dict[str, Any]]:
    """GET /readyz: its status and body (503 is an answer, not an error)."""
    try:
        return 200, get_json(service.base, "/readyz")
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def _says_nothing_twice(service: FleetService) -> None:
    """Wait until two page views in a row say nothing: on a loaded machine a view's store probe can take longer
    than the page waits for it (STORE_PROBE_TIMEOUT_S), and that view then says the store did not answer."""
    quiet = 0
    for _ in range(POLLS_MAX):
        quiet = quiet + 1 if _problems(service) == [] else 0
        if quiet == 2:
            return
        time.sleep(0.01)
    raise AssertionError(f"the page never said nothing twice in a row: {_problems(service)}")


def _behind_said(service: FleetService, url: str, now: float) -> None:
    """A worker stopped (SIGSTOP) and an event appended: no audit can be published that covers it, the page
    says the workers are behind the store (it said nothing while they were not), and /readyz says not ready,
    naming the worker's partitions. The event changes no finding at `now` (a map with a far deadline); the
    worker goes on (SIGCONT), folds it, and the service is ready, folded through it."""
    _says_nothing_twice(service)  # seen twice, nothing unread: not behind
    code, ready = _ready(service)
    assert (code, ready["ready"], ready["error"]) == (200, True, None)
    worker = service.get("/fleet/status")["workers"][0]
    os.kill(worker["pid"], signal.SIGSTOP)
    try:
        store = open_store(url)
        store.append([Side("late-0/tp0", start_ts=now - 0.5).map("tx-late", "r-late", blocks=(1,), deadline=now + 1e6)])
        assert isinstance(store, NatsStore)
        last = through_cursor(store.last_sequence())  # the cursor below which the stream holds every event
        store.close()
        seen: list[str] = []
        for _ in range(POLLS_MAX):
            seen = _problems(service)
            if seen == ["behind"]:
                break
            time.sleep(0.01)
        assert seen == ["behind"]
        code, ready = _ready(service)
        assert (code, ready["ready"]) == (503, False)
        assert ready["error"] == f"the worker of partitions {worker['partitions']} did not answer within 0.5 s"
        assert ready["cursor"] < last
    finally:
        os.kill(worker["pid"], signal.SIGCONT)
    for _ in range(POLLS_MAX):
        code, ready = _ready(service)
        if code == 200 and ready["cursor"] == last:
            break
        time.sleep(0.01)
    assert (code, ready["ready"], ready["cursor"]) == (200, True, last)


def test_four_partition_workers_answer_as_one_fold_of_the_stream(
    stream: tuple[str, list[Event], int], tmp_path: Path
) -> None:
    url, stored, last_seq = stream
    now = max(e.ts for e in stored) + 1.0
    # Behind as soon as an event it holds is seen not covered twice (the page's check, tried below).
    service = FleetService(url, "all", 4, tmp_path / "service.log", KVLEDGER_BEHIND_AFTER_S="0",
                           KVLEDGER_READY_TIMEOUT_S="0.5")  # fmt: skip
    one = FleetService(url, None, 1, tmp_path / "one.log")  # the one-process service over the same stream
    try:
        service.folded_through(last_seq)
        got = service.get(f"/audit?now={now!r}&limit=1000")
        assert got["findings"] == one_fold_findings(stored, now)
        _same_summary_and_metrics(service, one, stored, now)
        one.stop()
        # /transfers: every side, in the order one fold first saw them (paged 7 at a time)
        order = first_seen(stored)
        assert service.listed() == order
        reused = next(tid for tid in {t for _, t in order} if sum(1 for _, t in order if t == tid) >= 2)
        detail = service.get(f"/transfers/{reused}?now={now!r}")
        assert sorted(s["source"] for s in detail["sides"]) == sorted(s for s, t in order if t == reused)
        assert len(detail["timeline"]) == sum(1 for e in stored if e.transfer_id == reused)
        # A worker killed: the service starts it again, it folds its partitions again (no snapshot yet), and
        # what it tells again is passed over by the merge (the same findings, none twice).
        status = service.get("/fleet/status")
        os.kill(status["workers"][0]["pid"], signal.SIGKILL)
        for _ in range(POLLS_MAX):
            try:
                status = get_json(service.base, "/fleet/status")
            except urllib.error.HTTPError as error:
                assert error.code == 503  # asked of the worker as it died: ask again
                continue
            if status["restarts"] >= 1:
                break
            time.sleep(0.01)
        assert status["restarts"] == 1
        service.folded_through(last_seq)
        assert service.get(f"/audit?now={now!r}&limit=1000")["findings"] == got["findings"]
        service.published_after(time.time())
        _behind_said(service, url, now)
    finally:
        service.stop()  # its workers save their folds (and acknowledge) as they stop
        one.stop()
    # Started again: the workers restore their saved folds and fold nothing again; the new merge is told
    # every merge item they kept, and says the same.
    again = FleetService(url, "all", 2, tmp_path / "again.log")
    try:
        again.folded_through(last_seq)
        status = again.get("/fleet/status")
        assert all(p["restored"] == p["applied"] > 0 for p in status["folded"].values())  # nothing folded again
        assert again.get(f"/audit?now={now!r}&limit=1000")["findings"] == got["findings"]
    finally:
        again.stop()


def test_two_services_splitting_the_partitions_merge_into_one_answer(
    stream: tuple[str, list[Event], int], tmp_path: Path
) -> None:
    url, stored, last_seq = stream
    now = max(e.ts for e in stored) + 1.0
    services = [FleetService(url, "0-1", 1, tmp_path / "a.log"), FleetService(url, "2-3", 1, tmp_path / "b.log")]
    try:
        for service in services:
            service.folded_through(last_seq)
        merged = merge_services([s.base for s in services], now)
        assert [json.loads(finding_out(f).model_dump_json()) for f in merged.findings] == one_fold_findings(stored, now)
        assert merged.events == len(stored)
        alone = services[0].get(f"/audit?now={now!r}&limit=1000")  # one service: its partitions only
        assert 0 < alone["total"] < len(merged.findings)
    finally:
        for service in services:
            service.stop()


def test_the_workers_service_tails_streams_and_ingests_what_its_workers_then_fold(
    stream: tuple[str, list[Event], int], tmp_path: Path
) -> None:
    """GET /events and /events/stream read the stream as the one-process service does; POST /events stores a
    batch (idempotently), whose cursor /readyz reaches once the workers folded it, and it is listed then."""
    url, _, last_seq = stream
    service = FleetService(url, "all", 2, tmp_path / "service.log", KVLEDGER_TOKEN=TOKEN)
    store = open_store(url)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    side = Side("remote-0/tp0")
    batch = {"events": [msgspec.to_builtins(side.map(f"tx-r{i}", f"r-{i}")) for i in range(3)]}
    try:
        service.folded_through(last_seq)
        rows = store.tail(0, 100_000)
        with http(service.base) as client:
            page = client.get("/events", params={"after_seq": rows[9][0], "limit": 5}).json()
            assert [r["cursor"] for r in page["events"]] == [c for c, _ in rows[10:15]]
            assert page["next_after_seq"] == rows[14][0]
            assert client.post("/events", json=batch).status_code == 401
            wrong = {"events": [{**batch["events"][0], "seq": -1}]}
            refused = client.post("/events", json=wrong, headers=auth)
            assert refused.status_code == 422 and "seq" in refused.text
            assert "ingest" in _problems(service)  # the page says ingest is failing ...
            with client.stream("GET", "/events/stream", params={"after_seq": rows[-1][0]}) as sse:
                lines = sse.iter_lines()
                first = client.post("/events", json=batch, headers=auth).json()
                streamed: list[int] = []
                for line in lines:
                    if line.startswith("id: "):
                        streamed.append(int(line.removeprefix("id: ")))
                        if len(streamed) == 3:
                            break
                assert "kvledger_streams_open 1.0" in client.get("/metrics").text
            wait_for(lambda: "kvledger_streams_open 0.0" in client.get("/metrics").text)  # ended with its client
            appended = store.tail(rows[-1][0], 100)
            # The batch's events, one message per partition (cursor order is not the batch's); the bad one: nothing.
            assert sorted(e.transfer_id for _, e in appended) == ["tx-r0", "tx-r1", "tx-r2"]
            assert (first["received"], first["inserted"], first["duplicates"]) == (3, 3, 0)
            assert "ingest" not in _problems(service)  # ... until a batch is stored again
            assert streamed == [c for c, _ in appended] and first["cursor"] == appended[-1][0]
            again = client.post("/events", json=batch, headers=auth).json()
            assert (again["inserted"], again["duplicates"]) == (0, 3)
            wait_for(lambda: client.get("/readyz").json()["cursor"] >= first["cursor"])
            listed = client.get("/transfers", params={"source": "remote-0/tp0"}).json()["transfers"]
            assert [t["transfer_id"] for t in listed] == [e.transfer_id for _, e in appended]
    finally:
        store.close()
        service.stop()
