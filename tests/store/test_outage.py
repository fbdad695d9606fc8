"""PostgreSQL goes away mid-run (a real loopback TCP proxy is cut), then stalls (another session holds a
lock on the events table), and one event it cannot store arrives meanwhile: appends never wait, the bad
event is quarantined, nothing else is lost or duplicated."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import make_url

from kvledger.ledger.events import Event, from_json
from kvledger.ledger.log import EventLog
from kvledger.ledger.store.connect import open_store
from kvledger.ledger.store.writer import BackgroundWriter
from kvledger.ledger.synth import SynthConfig, generate
from tests.ledger.builders import Side
from tests.store.test_stalls import SHORT_LOCK_TIMEOUT, table_locked

pytestmark = pytest.mark.postgres

OUTAGE_EVENTS = 3_000
"""Events appended while the server is unreachable: several times the writer's queue."""

LOCKED_EVENTS = 1_500
"""Events appended while another session holds the events table (each batch fails by lock timeout)."""

LOCK_POLLS_MAX = 3_000


def test_outage_never_blocks_appends_and_loses_nothing(
    pg_url: str, tcp_proxy: Callable[..., object], tmp_path: Path
) -> None:
    direct = make_url(pg_url.replace("postgresql+psycopg", "postgresql"))
    proxy = tcp_proxy(direct.host or "127.0.0.1", direct.port or 5432)
    proxied = pg_url.replace(f"{direct.host}:{direct.port}", f"127.0.0.1:{proxy.port}")  # type: ignore[attr-defined]
    store = open_store(proxied + SHORT_LOCK_TIMEOUT, create=True)
    writer = BackgroundWriter(store, tmp_path / "spill", queue_events_max=500, batch_events_max=100).start()
    events = [e for e in generate(SynthConfig(transfers=2_000, seq_assigned=False), seed=5)]
    logs: dict[str, EventLog] = {}
    appended: list[Event] = []
    latencies_ns: list[int] = []
    outage = range(len(events) // 4, len(events) // 4 + OUTAGE_EVENTS)
    locked = range(outage.stop + 500, outage.stop + 500 + LOCKED_EVENTS)
    stored_during_outage = failed_before_lock = lock_failures = -1
    lock_error = ""
    schema = pg_url.rsplit("schema=", 1)[1]
    lock = table_locked(schema)
    odd_log = EventLog("odd/tp0")
    odd_log.subscribe(writer.put)
    unstorable = odd_log.append(Side("odd/tp0").map("t" * 300, "r"))  # an id wider than the events table holds
    for i, event in enumerate(events):
        if i == outage.start:
            proxy.stop()  # type: ignore[attr-defined]
        if i == outage.stop:
            stored_during_outage = writer.stats()["written"]
            proxy.start()  # type: ignore[attr-defined]
        if i == locked.start:
            lock.__enter__()
            failed_before_lock = writer.stats()["failed_attempts"]
        if i == locked.stop:
            # Held until a batch has failed on it (a bound on polls, not a timing claim): the stall happened.
            for _ in range(LOCK_POLLS_MAX):
                stats = writer.stats()
                if stats["failed_attempts"] > failed_before_lock and "lock timeout" in str(stats["last_error"]):
                    break
                time.sleep(0.01)
            lock_failures = writer.stats()["failed_attempts"] - failed_before_lock
            lock_error = str(writer.stats()["last_error"])
            lock.__exit__(None, None, None)
        log = logs.get(event.source)
        if log is None:
            log = logs[event.source] = EventLog(event.source)
            log.subscribe(writer.put)
        started = time.perf_counter_ns()
        appended.append(log.append(event))
        latencies_ns.append(time.perf_counter_ns() - started)
        if (i in outage or i in locked) and i % 100 == 0:
            time.sleep(0.02)  # the outage lasts a while in wall time, not just a few microseconds
    assert writer.close(timeout=60), writer.stats()
    stats = writer.stats()
    verify = open_store(pg_url)  # straight to the server, not through the proxy
    stored = list(verify.read())
    quarantined = [from_json(q.body) for q in verify.quarantined()]
    verify.close()
    store.close()
    latencies_ns.sort()
    print(
        f"\noutage test: {len(appended)} appends, {OUTAGE_EVENTS} while PostgreSQL was cut off; append latency "
        f"p50 {latencies_ns[len(latencies_ns) // 2] / 1000:.1f} us, max {latencies_ns[-1] / 1000:.1f} us; "
        f"{LOCKED_EVENTS} while the events table was locked; spilled {stats['spilled']}, failed attempts "
        f"{stats['failed_attempts']}, written {stats['written']}, duplicates {stats['duplicates']}, "
        f"quarantined {stats['quarantined']}"
    )
    assert stored == appended  # every event exactly once, in order
    assert quarantined == [unstorable] and stats["quarantined"] == 1
    assert lock_failures > 0 and "lock timeout" in lock_error  # the writer met the lock, timed out, went on
    assert stats["spilled"] > 0 and stats["failed_attempts"] > 0 and stats["dropped"] == 0
    assert stored_during_outage < len(appended)  # the store really was behind while cut off
