"""Partition workers over a NATS stream of the test's own server (`kvledger.ledger.fleet`, durable pull
consumers in `kvledger.ledger.store.nats_consumer`): a worker process killed (SIGKILL) while it folds,
another killed between a save and its acknowledgement, and a third started after them finish the stream
with every event folded exactly once; the partitions' answers, merged, are what an offline replay of the
exported stream says."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import msgspec
import pytest

from kvledger.cli.export import store_to_jsonl
from kvledger.ledger.audit import audit
from kvledger.ledger.events import Drop, Event
from kvledger.ledger.fleet import PartitionFold, run_worker, snapshot_source
from kvledger.ledger.jsonl import read_events
from kvledger.ledger.limits import FORGED_KEPT_MAX
from kvledger.ledger.merge import batched
from kvledger.ledger.partition import partition_of
from kvledger.ledger.partitioned import PartitionAnswer, merge
from kvledger.ledger.replay import replay_chunks
from kvledger.ledger.store.connect import open_store
from kvledger.ledger.store.nats_consumer import PartitionConsumers, consumer_name
from kvledger.ledger.store.nats_store import NatsStore
from kvledger.ledger.store.partition_source import Delivered
from tests.ledger.builders import Side
from tests.ledger.histories import Shape, history
from tests.store.fleet_worker import digest, spawn
from tests.store.nats_server import NatsServer

pytestmark = pytest.mark.nats

PARTITIONS = 4
SHAPE = Shape(transfers=150, span_s=300.0, block_pool=8, reuse_rate=0.2, orphan_rate=0.1,
              consumers=("decode-0/tp0", "decode-1/tp0"))  # fmt: skip


def test_workers_killed_mid_fold_and_between_save_and_ack_fold_every_event_once(
    server: NatsServer, tmp_path: Path
) -> None:
    url = f"{server.url}/workers?partitions={PARTITIONS}"
    events = history(5, SHAPE)
    store = open_store(url, create=True)
    assert isinstance(store, NatsStore)
    for batch in batched(events, 40):  # many small messages: a worker fetching 2 at a time folds for a while
        store.append(batch)
    last_seq = store.last_sequence()
    store.close()
    exported = tmp_path / "stream.jsonl"
    assert store_to_jsonl(url, exported) == len(events)
    stored = list(read_events(exported))
    now = max(e.ts for e in stored) + 1.0
    out = tmp_path / "answers.msgpack"

    # 1. Killed while it folds: after its second save, wherever it is then.
    first = spawn(url, range(PARTITIONS), out, last_seq, now, "--fetch", "2", "--snapshot-every-events", "150")
    assert first.stdout is not None
    saves = [first.stdout.readline() for _ in range(2)]
    assert all(line.startswith("saved ") for line in saves), saves
    first.kill()
    first.wait()
    assert not out.exists()  # killed before it folded the stream
    # 2. Killed right after a save, before its acknowledgement: the saved messages come again.
    second = spawn(url, range(PARTITIONS), out, last_seq, now, "--fetch", "2", "--snapshot-every-events", "150",
                   "--crash-after-save", "2")  # fmt: skip
    second.communicate()
    assert second.returncode == -9
    assert not out.exists()
    # 3. To the end.
    third = spawn(url, range(PARTITIONS), out, last_seq, now)
    third.communicate()
    assert third.returncode == 0
    report = msgspec.msgpack.decode(out.read_bytes())
    assert report["redelivered"] > 0  # what the second saved and did not acknowledge was delivered again
    answers = {int(p): v for p, v in report["answers"].items()}
    assert sorted(answers) == list(range(PARTITIONS))
    assert sum(n for _, _, n in answers.values()) == len(stored)  # 0 lost ...
    assert sum(d for _, d, _ in answers.values()) & ((1 << 64) - 1) == digest(stored)  # ... 0 folded twice
    merged = merge(msgspec.msgpack.decode(a, type=PartitionAnswer) for a, _, _ in answers.values())
    one = replay_chunks(batched(stored, 64))
    expected = audit(one.state, now)
    assert any(f.code == "double_owner" for f in expected) and len({f.code for f in expected}) > 3
    assert merged.findings == expected
    assert merged.releases == one.releases
    assert merged.events == len(stored)


def test_two_services_keep_positions_of_their_own(server: NatsServer) -> None:
    url = f"{server.url}/positions?partitions=2"
    store = open_store(url, create=True)
    assert isinstance(store, NatsStore)
    events = history(2, Shape(transfers=20))
    store.append(events)
    a = PartitionConsumers(store, [0, 1], service="a")
    b = PartitionConsumers(store, [0], service="b")
    got_a = a.fetch()
    assert sum(len(d.rows) for d in got_a) == len(events)
    a.ack(0, got_a[0].last_seq)
    assert a.position(0) == got_a[0].last_seq > 0
    assert b.position(0) == 0  # b's consumer is its own
    assert len(b.fetch()[0].rows) == len(got_a[0].rows)
    assert consumer_name("a", "positions", 0) != consumer_name("b", "positions", 0)
    with pytest.raises(ValueError):
        consumer_name("a.b", "positions", 0)
    a.close()
    b.close()
    store.close()


def test_a_worker_rides_out_its_server_killed_and_restarted(server: NatsServer, tmp_path: Path) -> None:
    url = f"{server.url}/outage?partitions={PARTITIONS}"
    store = open_store(url, create=True)
    assert isinstance(store, NatsStore)
    events = history(8, Shape(transfers=60, consumers=("decode-0/tp0", "decode-1/tp0")))
    for batch in batched(events, 20):
        store.append(batch)
    last_seq = store.last_sequence()
    folding, away = threading.Event(), threading.Event()
    rounds_away: list[int] = []

    def between(folds: dict[int, PartitionFold], delivered: list[Delivered]) -> bool:
        if any(d.rows for d in delivered):
            folding.set()
        if server.process is None and not any(d.rows for d in delivered):
            rounds_away.append(1)
            away.set()
        return not all(f.upto >= last_seq for f in folds.values())

    result: list[dict[int, PartitionFold]] = []
    worker = threading.Thread(
        target=lambda: result.append(run_worker(store, range(PARTITIONS), service="w", between=between,
                                                fetch_messages=2, fetch_timeout_s=0.05)),
    )  # fmt: skip
    worker.start()
    assert folding.wait(60)
    server.kill()  # mid-fold: its fetches fail while the server is away
    assert away.wait(60)
    server.start()
    worker.join(120)
    assert not worker.is_alive() and result, "the worker did not finish after the server came back"
    folds = result[0]
    stored = list(store.read())
    assert sum(f.folded.events for f in folds.values()) == len(stored) == len(events)
    assert sum(f.digest for f in folds.values()) & ((1 << 64) - 1) == digest(stored)
    now = max(e.ts for e in stored) + 1.0
    merged = merge(f.answer(now, upto=last_seq) for f in folds.values())
    assert merged.findings == audit(replay_chunks(batched(stored, 64)).state, now)
    assert all(consumer.position(p) == folds[p].saved for p in range(PARTITIONS) for consumer in [_bound(store)])
    store.close()


def _bound(store: NatsStore) -> PartitionConsumers:
    """The worker's consumers, bound again: where they are."""
    return PartitionConsumers(store, range(PARTITIONS), service="w", folded=dict.fromkeys(range(PARTITIONS), 1 << 40))


def test_drops_naming_every_partition_merge_into_one_fold_s_latest_and_read_with_their_transfer(
    nats_url: str,
) -> None:
    """A `drop` is folded in partition 0 whichever transfer it names (`partition_of_event`), so partition 0 keeps
    the whole stream's latest drops, as one fold does. More drops than a fold keeps (FORGED_KEPT_MAX), naming
    transfers of every partition: the workers' merged findings, `forged_message` evidence included, are one
    fold's. A transfer's drops, stored on partition 0's subjects, are read with its other events."""
    events = history(3, Shape(transfers=40, consumers=("decode-0/tp0", "decode-1/tp0")))
    forger = Side("decode-9/tp0", start_ts=max(e.ts for e in events))
    tids = sorted({e.transfer_id for e in events})
    drops = [
        forger.drop(tids[i % len(tids)], reason=("bad_mac", "unlisted")[i % 2]) for i in range(2 * FORGED_KEPT_MAX)
    ]
    assert {partition_of(d.transfer_id, PARTITIONS) for d in drops} == set(range(PARTITIONS))
    every = len(events) // len(drops) + 1
    mixed: list[Event] = []
    for i, e in enumerate(events):  # the drops spread through the history, not after it
        mixed.append(e)
        if i % every == 0 and drops:
            mixed.append(drops.pop(0))
    mixed += drops
    store = open_store(nats_url, create=True)
    assert isinstance(store, NatsStore)
    for batch in batched(mixed, 40):
        store.append(batch)
    last_seq = store.last_sequence()
    stored = list(store.read())
    assert len(stored) == len(mixed)

    def to_the_end(folds: dict[int, PartitionFold], delivered: list[Delivered]) -> bool:
        return not all(f.upto >= last_seq for f in folds.values())

    folds = run_worker(store, range(PARTITIONS), service="drops", between=to_the_end, fetch_timeout_s=0.05)
    assert folds[0].folded.state.forged_by_reason == {"bad_mac": FORGED_KEPT_MAX, "unlisted": FORGED_KEPT_MAX}
    now = max(e.ts for e in stored) + 1.0
    merged = merge(f.answer(now, upto=last_seq) for f in folds.values())
    expected = audit(replay_chunks(batched(stored, 64)).state, now)
    assert sum(f.code == "forged_message" for f in expected) == FORGED_KEPT_MAX
    assert merged.findings == expected
    tid = next(t for t in tids if partition_of(t, PARTITIONS) != 0)
    mine = [e for e in stored if e.transfer_id == tid]
    assert any(type(e) is Drop for e in mine) and any(type(e) is not Drop for e in mine)
    assert list(store.read(transfer_id=tid)) == mine
    assert list(store.read(transfer_id=tid, source=forger.source)) == [e for e in mine if e.source == forger.source]
    store.close()


def test_a_worker_s_snapshot_is_encoded_by_a_forked_child_while_it_folds_and_answers(
    nats_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker saves its folds from a forked child (`kvledger.ledger.forked`): the lock its requests take is
    held only for the fork. A child held still (its encode waits on a file) keeps no snapshot from being
    saved, yet the worker folds the stream to its end and its lock is free between deliveries; once the child
    goes on, its snapshots are saved at what the folds had applied at the fork and acknowledged."""
    events = history(9, SHAPE)
    store = open_store(nats_url, create=True)
    assert isinstance(store, NatsStore)
    for batch in batched(events, 40):
        store.append(batch)
    last_seq = store.last_sequence()
    gate = tmp_path / "go"
    parent, encode = os.getpid(), PartitionFold.encode

    def held_in_the_child(fold: PartitionFold) -> bytes:
        while os.getpid() != parent and not gate.exists():
            time.sleep(0.01)
        return encode(fold)

    monkeypatch.setattr(PartitionFold, "encode", held_in_the_child)
    lock = threading.Lock()
    seen: dict[str, int] = {"calls": 0}

    def saved() -> dict[int, int]:
        found = {p: store.latest_snapshot(snapshot_source("snap", p, PARTITIONS)) for p in range(PARTITIONS)}
        return {p: s.seq for p, s in found.items() if s is not None}

    def between(folds: dict[int, PartitionFold], delivered: list[Delivered]) -> bool:
        seen["calls"] += 1
        assert seen["calls"] < 4_000, "the child's snapshots were never saved"
        assert lock.acquire(blocking=False)  # free between deliveries, a child encoding or not
        lock.release()
        if not gate.exists():
            if all(f.upto >= last_seq for f in folds.values()):
                assert saved() == {}  # the child is held: nothing saved, yet every event folded
                assert all(f.saved == 0 for f in folds.values())
                gate.touch()
            return True
        found = saved()
        if not found:
            return True
        for p, seq in found.items():
            assert seq == folds[p].saved and 0 < seq <= folds[p].applied
        return False

    folds = run_worker(
        store, range(PARTITIONS), service="snap", between=between, lock=lock, fetch_messages=2,
        snapshot_every_events=50, fetch_timeout_s=0.05,
    )  # fmt: skip
    assert gate.exists() and sum(f.folded.events for f in folds.values()) == len(events)
    store.close()
