"""PostgreSQL goes away mid-run (a real loopback TCP proxy is cut): appends never wait, nothing is lost."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import make_url

from ledger.events import Event
from ledger.log import EventLog
from ledger.store.connect import open_store
from ledger.store.writer import BackgroundWriter
from ledger.synth import SynthConfig, generate

pytestmark = pytest.mark.postgres

OUTAGE_EVENTS = 3_000
"""Events appended while the server is unreachable: several times the writer's queue."""


def test_outage_never_blocks_appends_and_loses_nothing(
    pg_url: str, tcp_proxy: Callable[..., object], tmp_path: Path
) -> None:
    direct = make_url(pg_url.replace("postgresql+psycopg", "postgresql"))
    proxy = tcp_proxy(direct.host or "127.0.0.1", direct.port or 5432)
    proxied = pg_url.replace(f"{direct.host}:{direct.port}", f"127.0.0.1:{proxy.port}")  # type: ignore[attr-defined]
    store = open_store(proxied, create=True)
    writer = BackgroundWriter(store, tmp_path / "spill", queue_events_max=500, batch_events_max=100).start()
    events = [e for e in generate(SynthConfig(transfers=2_000, seq_assigned=False), seed=5)]
    logs: dict[str, EventLog] = {}
    appended: list[Event] = []
    latencies_ns: list[int] = []
    outage = range(len(events) // 3, len(events) // 3 + OUTAGE_EVENTS)
    stored_during_outage = -1
    for i, event in enumerate(events):
        if i == outage.start:
            proxy.stop()  # type: ignore[attr-defined]
        if i == outage.stop:
            stored_during_outage = writer.stats()["written"]
            proxy.start()  # type: ignore[attr-defined]
        log = logs.get(event.source)
        if log is None:
            log = logs[event.source] = EventLog(event.source)
            log.subscribe(writer.put)
        started = time.perf_counter_ns()
        appended.append(log.append(event))
        latencies_ns.append(time.perf_counter_ns() - started)
        if i in outage and i % 100 == 0:
            time.sleep(0.02)  # the outage lasts a while in wall time, not just a few microseconds
    assert writer.close(timeout=60), writer.stats()
    stats = writer.stats()
    verify = open_store(pg_url)  # straight to the server, not through the proxy
    stored = list(verify.read())
    verify.close()
    store.close()
    latencies_ns.sort()
    print(
        f"\noutage test: {len(appended)} appends, {OUTAGE_EVENTS} while PostgreSQL was cut off; append latency "
        f"p50 {latencies_ns[len(latencies_ns) // 2] / 1000:.1f} us, max {latencies_ns[-1] / 1000:.1f} us; "
        f"spilled {stats['spilled']}, failed attempts {stats['failed_attempts']}, written {stats['written']}, "
        f"duplicates {stats['duplicates']}"
    )
    assert stored == appended  # every event exactly once, in order
    assert stats["spilled"] > 0 and stats["failed_attempts"] > 0 and stats["dropped"] == 0
    assert stored_during_outage < len(appended)  # the store really was behind while cut off
