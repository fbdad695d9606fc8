"""`kvledger serve --partitions all --workers 2` over a SQL store (a real SQLite file, and PostgreSQL) as a real
process: two partition workers, each reading the store's tail and folding its partitions, answer /audit and
/transfers as one fold of the store does; the service killed (SIGKILL) and started again, its workers
restore their saved folds from the store's snapshots table, fold only what was appended since, and answer
for the whole store. And a worker process killed while it folds, then one that finishes: every event folded
once (a digest of (source, seq)), the merged answers one fold's."""

from __future__ import annotations

import json
import sqlite3
import urllib.request
from pathlib import Path

import msgspec
import pytest

from kvledger.api.views import display_url
from kvledger.ledger.audit import audit
from kvledger.ledger.events import Event
from kvledger.ledger.fleet import PartitionFold, partition_count, run_worker, snapshot_source
from kvledger.ledger.jsonl import write_log
from kvledger.ledger.merge import batched
from kvledger.ledger.partition import partition_of_event
from kvledger.ledger.partitioned import PartitionAnswer, merge
from kvledger.ledger.replay import replay_chunks
from kvledger.ledger.store.connect import open_store
from kvledger.ledger.store.partition_source import Delivered
from kvledger.ledger.store.schema import snapshots
from tests.ledger.builders import Side
from tests.ledger.histories import Shape, history
from tests.store.conftest import backend_url
from tests.store.fleet_service import FleetService, first_seen, one_fold_findings
from tests.store.fleet_worker import digest, spawn

SHAPE = Shape(transfers=80, span_s=200.0, block_pool=8, reuse_rate=0.2, orphan_rate=0.1,
              consumers=("decode-0/tp0", "decode-1/tp0"))  # fmt: skip


def _per_partition(events: list[Event], partitions: int) -> dict[str, int]:
    out: dict[str, int] = {str(p): 0 for p in range(partitions)}
    for e in events:
        out[str(partition_of_event(e, partitions))] += 1
    return out


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def sql_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return backend_url(request, tmp_path)


def test_two_workers_over_a_sql_store_answer_as_one_fold_and_go_on_from_their_snapshots(
    sql_url: str, tmp_path: Path
) -> None:
    events = history(5, SHAPE)
    cut = len(events) * 2 // 3
    store = open_store(sql_url, create=True)
    for batch in batched(events[:cut], 40):
        store.append(batch)
    first_part = [e for _, e in store.tail(0, 100_000)]
    last_cursor = store.tail(0, 100_000)[-1][0]
    store.quarantine([(Side("prefill-0/tp0").map("t" * 300, "r"), "UnstorableEvent: field 'transfer_id': too long")])
    partitions = partition_count(store)
    service = FleetService(sql_url, "all", 2, tmp_path / "service.log")
    try:
        status = service.folded_through(last_cursor)
        # Ready: the store and both workers answer; every partition folded through the store's last cursor.
        assert service.get("/readyz") == {"ready": True, "store": display_url(sql_url), "cursor": last_cursor,
                                          "error": None}  # fmt: skip
        quarantine = service.get("/quarantine")
        assert quarantine["total"] == 1 and quarantine["events"][0]["reason"].endswith("too long")
        # An uploaded log replayed offline, the store untouched: one fold's findings at its last event's time.
        write_log(tmp_path / "incident.jsonl", first_part)
        upload = urllib.request.Request(f"{service.base}/replay?limit=1000", (tmp_path / "incident.jsonl").read_bytes())
        with urllib.request.urlopen(upload, timeout=60) as response:
            replayed = json.loads(response.read())
        assert replayed["events"] == len(first_part) and replayed["now"] == first_part[-1].ts
        assert replayed["findings"] == one_fold_findings(first_part, replayed["now"])
        assert service.get("/readyz")["cursor"] == last_cursor
        now = max(e.ts for e in first_part) + 1.0
        assert service.get(f"/audit?now={now!r}&limit=1000")["findings"] == one_fold_findings(first_part, now)
        assert service.listed() == first_seen(first_part)  # every side, in the order one fold first saw them
        assert {p: v["events"] for p, v in status["folded"].items()} == _per_partition(first_part, partitions)
        service.kill([w["pid"] for w in status["workers"]])
    finally:
        service.stop()
    # What the workers saved as they went: one snapshot per partition that folded events, named apart from
    # the one-process service's (source "").
    with store.engine.connect() as conn:  # type: ignore[attr-defined]
        names = {row[0] for row in conn.execute(snapshots.select().with_only_columns(snapshots.c.source))}
    assert names == {snapshot_source("test", p, partitions, stream=False) for p in range(partitions)
                     if status["folded"][str(p)]["events"]}  # fmt: skip
    for batch in batched(events[cut:], 40):
        store.append(batch)
    stored = [e for _, e in store.tail(0, 100_000)]
    last_cursor = store.tail(0, 100_000)[-1][0]
    store.close()
    now = max(e.ts for e in stored) + 1.0
    again = FleetService(sql_url, "all", 2, tmp_path / "again.log")
    try:
        restarted = again.folded_through(last_cursor)
        for p, before in status["folded"].items():  # each partition went on from its saved fold
            assert restarted["folded"][p]["restored"] == before["applied"]
        # ... and folded only what came after it: each event once
        assert {p: v["events"] for p, v in restarted["folded"].items()} == _per_partition(stored, partitions)
        assert again.get(f"/audit?now={now!r}&limit=1000")["findings"] == one_fold_findings(stored, now)
    finally:
        again.stop()


def test_a_worker_killed_while_it_folds_a_sqlite_store_folds_every_event_once(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    store = open_store(url, create=True)
    for batch in batched(history(5, SHAPE), 40):
        store.append(batch)
    rows = store.tail(0, 100_000)
    store.close()
    stored, last = [e for _, e in rows], rows[-1][0]
    now = max(e.ts for e in stored) + 1.0
    out = tmp_path / "answers.msgpack"
    # Killed while it folds (3 rows a fetch, a save every 100 events): after its fourth save.
    first = spawn(url, range(16), out, last, now, "--fetch", "3", "--snapshot-every-events", "100")
    assert first.stdout is not None
    saves = [first.stdout.readline() for _ in range(4)]
    assert all(line.startswith("saved ") for line in saves), saves
    first.kill()
    first.wait()
    assert not out.exists()  # killed before it read the store to its end
    # Started again: from the saved folds, to the end.
    second = spawn(url, range(16), out, last, now)
    second.communicate()
    assert second.returncode == 0
    report = msgspec.msgpack.decode(out.read_bytes())
    answers = {int(p): v for p, v in report["answers"].items()}
    assert sorted(answers) == list(range(16))
    assert any(report["restored"].values())  # went on from the first one's saved folds
    assert sum(n for _, _, n in answers.values()) == len(stored)  # 0 lost ...
    assert sum(d for _, d, _ in answers.values()) & ((1 << 64) - 1) == digest(stored)  # ... 0 folded twice
    merged = merge(msgspec.msgpack.decode(a, type=PartitionAnswer) for a, _, _ in answers.values())
    one = replay_chunks(batched(stored, 64))
    assert merged.findings == audit(one.state, now)
    assert merged.releases == one.releases


def test_a_saved_fold_whose_rows_the_store_no_longer_holds_is_folded_again(tmp_path: Path) -> None:
    """SQLite gives a new row the highest rowid plus one: once the newest rows are deleted, rows appended
    after take their cursors again. A fold saved past them is not gone on from (it would skip the new rows
    and keep the deleted ones' effects): its partition is folded again from the store's start."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    events = history(5, SHAPE)
    store = open_store(url, create=True)
    store.append(events)
    last = store.tail(0, 100_000)[-1][0]

    def to_the_end(folds: dict[int, PartitionFold], delivered: list[Delivered]) -> bool:
        return not all(f.upto >= last for f in folds.values())

    run_worker(store, range(16), service="t", between=to_the_end, keep_releases=True)
    with sqlite3.connect(tmp_path / "ledger.db") as conn:
        conn.execute("DELETE FROM events WHERE cursor > ?", (last - 5,))
    conn.close()
    others = [msgspec.structs.replace(e, source="prefill-9/tp0") for e in events if e.source == "prefill-0/tp0"][:5]
    store.append(others)  # at the deleted rows' cursors
    rows = store.tail(0, 100_000)
    assert rows[-1][0] == last
    folds = run_worker(store, range(16), service="t", between=to_the_end, keep_releases=True)
    store.close()
    stored = [e for _, e in rows]
    assert sum(f.folded.events for f in folds.values()) == len(stored)
    assert all(f.restored == 0 for f in folds.values())
    now = max(e.ts for e in stored) + 1.0
    merged = merge(f.answer(now) for f in folds.values())
    assert merged.findings == audit(replay_chunks(batched(stored, 64)).state, now)


def test_behind_a_backlog_a_worker_saves_by_events_alone(tmp_path: Path) -> None:
    """Each save encodes the whole fold: while the tail's fetches come back full (a start over a large
    store) the clock does not make a worker save, only its events bound; once it has caught up it does."""
    store = open_store(f"sqlite:///{tmp_path / 'ledger.db'}", create=True)
    store.append(history(5, SHAPE))
    last = store.tail(0, 100_000)[-1][0]
    saved: list[tuple[int, int]] = []

    def to_the_end(folds: dict[int, PartitionFold], delivered: list[Delivered]) -> bool:
        return not all(f.upto >= last for f in folds.values())

    folds = run_worker(
        store, range(16), service="t", between=to_the_end, fetch_messages=10, snapshot_every_s=0.0,
        after_save=lambda fold: saved.append((fold.partition, fold.saved)),
    )  # fmt: skip
    store.close()
    assert last % 10 != 0  # the last fetch is not full: the worker has caught up there
    assert sorted(saved) == sorted((p, f.applied) for p, f in folds.items() if f.applied)  # once each, at the end
