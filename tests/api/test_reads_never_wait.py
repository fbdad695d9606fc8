"""Reads never wait on writes: a request without `?now=` is answered from the published audit while the next
audit holds the fold lock and an ingest's fold waits for it, and while a snapshot is being encoded (in a
forked child, the fold going on); a large batch is folded a slice at a time, the event loop running between
slices, and a replaced audit is freed a slice at a time off the loop. Each writer is held still by the test (a
gate), never timed."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
import pytest
from fastapi.testclient import TestClient

from kvledger.api import live as live_module
from kvledger.api import snapshots
from kvledger.api.app import create_app
from kvledger.api.live import Audited, Live, Written, _release
from kvledger.ledger.audit import Finding, audit
from kvledger.ledger.events import Event, TransferId
from kvledger.ledger.store.connect import open_store
from tests.api.conftest import TOKEN, settings_for, wait_for
from tests.api.seed import incident_events
from tests.ledger.builders import Side
from tests.store.conftest import backend_url, nats_available, nats_url  # noqa: F401  (fixtures backend_url asks for)

AUTH = {"Authorization": f"Bearer {TOKEN}"}
GATE_WAIT_S = 60.0
"""How long a held writer waits for the test to let it go: a bound, never reached unless the test failed."""


@pytest.fixture(
    params=["memory", "sqlite", pytest.param("postgres", marks=pytest.mark.postgres),
            pytest.param("nats", marks=pytest.mark.nats)]
)  # fmt: skip
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh store of each backend in turn (the memory store: the service's own, empty)."""
    if request.param == "memory":
        return "memory://"
    made = backend_url(request, tmp_path)
    open_store(made, create=True).close()
    return made


@contextmanager
def _service(url: str) -> Iterator[tuple[TestClient, Live]]:
    """A started service over the store at `url`, writing no snapshot of its own, holding the incident's
    events (posted)."""
    app = create_app(settings_for(url, snapshot_every_events=0))
    with TestClient(app) as client:
        body = {"events": [msgspec.to_builtins(e) for e in incident_events()]}
        assert client.post("/events", json=body, headers=AUTH).status_code == 200
        yield client, app.state.live


def _batch(source: str, count: int) -> dict[str, Any]:
    """`count` maps never released: each a leak at the wall clock's `now`."""
    side = Side(source)
    return {"events": [msgspec.to_builtins(side.map(f"tx-{i}", f"r-{i}")) for i in range(count)]}


def _post(client: TestClient, body: dict[str, Any]) -> Future[int]:
    """POST /events on a thread of its own: the status it gets."""
    future: Future[int] = Future()
    threading.Thread(target=lambda: future.set_result(client.post("/events", json=body, headers=AUTH).status_code),
                     daemon=True).start()  # fmt: skip
    return future


def _reads_answer(client: TestClient) -> dict[str, Any]:
    """Every read that answers from the published audit answers now; GET /audit's answer."""
    assert client.get("/audit/summary").status_code == 200
    assert client.get("/transfers", params={"has_finding": True}).status_code == 200
    assert client.get("/metrics").status_code == 200
    audit = client.get("/audit")
    assert audit.status_code == 200
    answer: dict[str, Any] = audit.json()
    return answer


def _published_is_current(live: Live) -> bool:
    return live.audited is not None and live.audited.version == live.version


def test_get_audit_is_answered_while_the_next_audit_holds_the_fold_lock_and_an_ingest_waits(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every audit that starts once the test holds the gate is held. The first batch is posted on a thread of
    its own: the poller may fold it before the ingest does, and the audit of that fold then holds the lock the
    ingest's own fold waits for, so its POST may answer only once the gate is let go."""
    entered, let_go = threading.Event(), threading.Event()

    def held_audit(*args: Any) -> list[Finding]:
        if threading.current_thread().name.startswith("kvledger-audit") and not let_go.is_set():
            entered.set()
            assert let_go.wait(GATE_WAIT_S)
        return audit(*args)

    with _service(url) as (client, live):
        wait_for(lambda: _published_is_current(live))
        before = client.get("/audit").json()
        monkeypatch.setattr(live_module, "audit", held_audit)
        try:
            first = _post(client, _batch("first/tp0", 3))
            assert entered.wait(GATE_WAIT_S)  # the next audit runs on its thread, holding the fold lock
            assert live.fold_lock.locked()
            second = _post(client, _batch("second/tp0", 4))  # stored, then its fold waits for the lock
            during = _reads_answer(client)
            # The published audit: from before the first batch (its leaks are in the audit held), answered now.
            assert (during["counts"], during["total"]) == (before["counts"], before["total"])
            assert not second.done()
        finally:
            let_go.set()
        assert first.result(GATE_WAIT_S) == 200 and second.result(GATE_WAIT_S) == 200
        wait_for(lambda: _published_is_current(live))
        after = client.get("/audit").json()
    assert after["counts"]["leak"] == before["counts"]["leak"] + 3 + 4


def test_get_audit_is_answered_and_ingest_folds_while_a_snapshot_is_encoded(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The child `write` forks encodes the fold as it was at the fork, however far the service folds meanwhile."""
    entered, gate = tmp_path / "entered", tmp_path / "gate"
    os.mkfifo(gate)
    service_pid = os.getpid()
    real_encode = snapshots.encode

    def held_encode(live: Live, store_id: str | None = None) -> tuple[int, int, bytes]:
        if os.getpid() != service_pid:  # in the child: say so, then wait until the test writes to the gate
            entered.touch()
            fd = os.open(gate, os.O_RDONLY)
            os.read(fd, 1)
        return real_encode(live, store_id)

    monkeypatch.setattr(snapshots, "encode", held_encode)
    with _service(url) as (client, live):
        wait_for(lambda: _published_is_current(live))
        cursor, rows = live.cursor, live.rows_folded
        writing: Future[Written | None] = client.portal.start_task_soon(snapshots.write, live)  # type: ignore[union-attr]
        try:
            wait_for(entered.exists)
            wait_for(lambda: not live.fold_lock.locked())  # held for the fork only, not while the child encodes
            assert client.post("/events", json=_batch("during/tp0", 5), headers=AUTH).status_code == 200
            assert live.rows_folded == rows + 5  # folded while the child encodes
            wait_for(lambda: _published_is_current(live))
            assert _reads_answer(client)["counts"]["leak"] >= 5
            assert not writing.done()
        finally:
            let_go = os.open(gate, os.O_RDWR)  # never blocks, reader or not: the child goes on
            os.write(let_go, b"x")
            os.close(let_go)
        written = writing.result(GATE_WAIT_S)
        assert written is not None and (written.cursor, written.rows) == (cursor, rows)
        assert live.store is not None
        stored = live.store.latest_snapshot(snapshots.SOURCE)
    assert stored is not None and stored.seq == cursor
    doc = snapshots._decoder.decode(snapshots.unsealed(stored.body))
    assert (doc.cursor, doc.rows) == (cursor, rows)  # the fold at the fork, not the 5 events folded since


def test_a_child_that_fails_to_encode_is_a_failed_snapshot_naming_why(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    service_pid = os.getpid()
    real_encode = snapshots.encode

    def failing_encode(live: Live, store_id: str | None = None) -> tuple[int, int, bytes]:
        if os.getpid() != service_pid:
            raise RuntimeError("no room to encode")
        return real_encode(live, store_id)

    monkeypatch.setattr(snapshots, "encode", failing_encode)
    with _service(sqlite_url) as (client, live):
        with pytest.raises(snapshots.SnapshotFailed, match="RuntimeError: no room to encode"):
            client.portal.call(snapshots.write, live)  # type: ignore[union-attr]
        assert live.snapshot_written is None
        assert client.get("/audit").status_code == 200


def test_a_batch_larger_than_a_slice_is_folded_a_slice_at_a_time_the_loop_running_between(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(live_module, "FOLD_SLICE_EVENTS", 10)
    slices: list[int] = []
    ran_between: list[bool] = []
    real_fold = Live._fold

    def observed_fold(self: Live, rows: list[tuple[int, Event]]) -> None:
        if slices:  # was the loop's callback, scheduled during the slice before, run before this one?
            ran_between.append(bool(called))
        called.clear()
        asyncio.get_running_loop().call_soon(called.append, True)
        slices.append(len(rows))
        real_fold(self, rows)

    called: list[bool] = []
    with _service(sqlite_url) as (client, live):
        rows = live.rows_folded
        monkeypatch.setattr(Live, "_fold", observed_fold)
        assert client.post("/events", json=_batch("big/tp0", 35), headers=AUTH).status_code == 200
        assert live.rows_folded == rows + 35
    assert slices == [10, 10, 10, 5]
    assert ran_between == [True, True, True]


class _Watched(list[Finding]):
    """Findings that record the size of each slice deleted from them."""

    def __init__(self, findings: list[Finding], deleted: list[int]) -> None:
        super().__init__(findings)
        self.deleted = deleted

    def __delitem__(self, index: Any) -> None:
        self.deleted.append(len(self[index]))
        super().__delitem__(index)


def _replaced(count: int, deleted: list[int]) -> Audited:
    findings = [
        Finding(code="stuck", severity="warning", source="s/tp0", transfer_id=TransferId(f"tx-{i}"), request_id=None,
                block_ids=(i,), evidence=(i,), detail=f"finding {i}")
        for i in range(count)
    ]  # fmt: skip
    keys = {(f.source, f.transfer_id) for f in findings}
    return Audited(1, 0.0, _Watched(findings, deleted), {"stuck": count}, keys, 0.0)


def test_a_replaced_audit_is_freed_a_slice_at_a_time_unless_someone_still_holds_it() -> None:
    deleted: list[int] = []
    _release([_replaced(5000, deleted)])
    assert deleted == [live_module.RELEASE_SLICE] * 2 + [5000 - 2 * live_module.RELEASE_SLICE]
    held_deleted: list[int] = []
    held = _replaced(5000, held_deleted)
    findings, keys = held.findings, held.keys
    _release([held])
    assert held_deleted == [] and len(findings) == 5000 and len(keys) == 5000


def test_a_catch_up_that_never_ends_takes_turns_with_the_published_audit(sqlite_url: str) -> None:
    """Under a sustained stream a catch-up never finds the store's end. It holds the fold lock a batch at a
    time, so the audit (which takes the lock too) is published between two batches, of a fold that has
    moved on, while the catch-up is still going."""
    store = open_store(sqlite_url)
    store.append(incident_events())
    store.close()

    async def main() -> tuple[int, int, bool]:
        live = Live(settings_for(sqlite_url, tail_batch_max=1))  # one event a batch: a long catch-up
        try:
            await live.refresh(batch=1)  # opens the store, folds it all, one event at a time
            first = live.published()
            total = live.rows_folded
            appender, side = open_store(sqlite_url), Side("more/tp0")
            appender.append([side.map(f"tx-{i}", f"r-{i}") for i in range(300)])
            appender.close()
            catching_up = asyncio.create_task(live.catch_up(1))
            while live.rows_folded == total:  # the catch-up has begun
                await asyncio.sleep(0)
            audited = await live.publish_audit()
            still_going = not catching_up.done()
            await catching_up
            return audited.version - first.version, live.rows_folded - total, still_going
        finally:
            live.close()

    moved, folded, still_going = asyncio.run(main())
    assert folded == 300 and moved > 0 and still_going
