"""NATS JetStream faults on a server of the test's own: killed mid-publish and restarted, and a batch
published again after its duplicate window. Nothing is lost or stored twice, appends never wait, and an
offline replay of the stream (exported to JSONL) finds what a replay of the appended events finds."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvledger.cli.export import store_to_jsonl
from kvledger.ledger.audit import audit
from kvledger.ledger.events import Event
from kvledger.ledger.jsonl import read_events
from kvledger.ledger.log import EventLog
from kvledger.ledger.partition import partition_of_event
from kvledger.ledger.replay import replay_chunks
from kvledger.ledger.store.connect import open_store
from kvledger.ledger.store.writer import BackgroundWriter
from kvledger.ledger.synth import SynthConfig, generate
from tests.store.nats_server import NatsServer

pytestmark = pytest.mark.nats

OUTAGE_EVENTS = 1_500
"""Events appended while the server is dead: several times the writer's queue."""


def _findings(events: list[Event]) -> list[str]:
    result = replay_chunks([events])
    now = max(e.ts for e in events) + 3600
    return sorted(repr(f) for f in audit(result.state, now)) + sorted(repr(r) for r in result.releases)


def test_server_killed_mid_publish_and_restarted_loses_and_duplicates_nothing(
    server: NatsServer, tmp_path: Path
) -> None:
    url = f"{server.url}/fleet?partitions=4"
    store = open_store(url, create=True)
    writer = BackgroundWriter(store, tmp_path / "spill", queue_events_max=300, batch_events_max=100).start()
    events = list(generate(SynthConfig(transfers=800, seq_assigned=False, fault_rate=0.05), seed=11))
    logs: dict[str, EventLog] = {}
    appended: list[Event] = []
    outage = range(len(events) // 3, len(events) // 3 + OUTAGE_EVENTS)
    for i, event in enumerate(events):
        if i == outage.start:
            server.kill()  # batches are in flight: the writer's acks are lost with the server
        if i == outage.stop:
            server.start()
        log = logs.get(event.source)
        if log is None:
            log = logs[event.source] = EventLog(event.source)
            log.subscribe(writer.put)
        appended.append(log.append(event))
        if i in outage and i % 100 == 0:
            time.sleep(0.02)  # the outage lasts a while in wall time
    assert writer.close(timeout=60), writer.stats()
    stats = writer.stats()
    # The outage was met: events went through the spill file (a refused publish, or a backlog spilled while
    # the server was down: which one depends on timing), and none was dropped.
    assert stats["spilled"] + stats["respilled"] > 0 and stats["dropped"] == 0
    store.close()
    exported = tmp_path / "stream.jsonl"
    assert store_to_jsonl(url, exported) == len(appended)
    stored = list(read_events(exported))
    keys = [(e.source, e.seq) for e in stored]
    assert len(set(keys)) == len(keys)  # 0 duplicated
    assert sorted(keys) == sorted((e.source, e.seq) for e in appended)  # 0 lost
    by_key = {(e.source, e.seq): e for e in appended}
    assert all(by_key[(e.source, e.seq)] == e for e in stored)  # each as appended
    for source in logs:  # within a (partition, source) subject, in seq order, as a partition worker reads it
        for partition in range(4):
            seqs = [e.seq for e in stored if e.source == source and partition_of_event(e, 4) == partition]
            assert seqs == sorted(seqs)
    assert _findings(stored) == _findings(appended)


def test_a_batch_published_again_after_the_duplicate_window_is_stored_once(server: NatsServer) -> None:
    url = f"{server.url}/window?partitions=2&dup_window_s=2.5"
    events = list(generate(SynthConfig(transfers=20, concurrency=4), seed=3))
    first = open_store(url, create=True)
    assert first.append(events) == len(events)
    first.close()
    time.sleep(3.0)  # past the stream's duplicate window: the Msg-Id no longer protects the batch
    again = open_store(url)  # a new writer process: it knows nothing of what the first published
    assert again.append(events) == 0
    assert again.append(events[5:]) == 0  # a spilled batch cut differently: other Msg-Ids, same events
    assert again.count() == len(events)
    again.close()


def test_a_missing_stream_is_refused_naming_the_command_that_makes_it(server: NatsServer) -> None:
    from kvledger.ledger.store.base import StoreUnavailable

    with pytest.raises(StoreUnavailable, match="kvledger db upgrade"):
        open_store(f"{server.url}/nothing-here")
