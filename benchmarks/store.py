"""Store write throughput against raw sqlite3 in the same run, and the append latency the hot path sees.

(a) the store's real path: events put on the BackgroundWriter, which writes them to a
    SQLite store in batches; timed from the first put until close() has flushed all.
(b) the baseline: the same events encoded to the same rows (msgpack body, envelope
    columns) and written with raw sqlite3.executemany, WAL, same synchronous setting,
    same batch size, into a table created from the store's own DDL (same indexes).
`ratio` compares the best wall-clock rates; `cpu_ratio` the same runs per second of the
process's CPU time (all its threads: the puts, the writer, the driver), which other tenants
of a shared machine change far less.
Then EventLog.append latency with the writer subscribed and running, the events appended
at `--load` (0.5) times raw's rate: a load a healthy store takes, so `append_spilled`
(events put on the local spill file because the queue was full) is 0 unless the writer
falls behind. Last, `burst_spilled`: the same appends all at once (several times what
SQLite can take), where a bounded queue must spill. Prints one JSON line last.
Usage: python benchmarks/store.py [--events N] [--rounds R] [--load SHARE]
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: the repository's packages

from benchmarks.quick import parse_args
from kvledger.ledger.events import Event
from kvledger.ledger.log import EventLog
from kvledger.ledger.store.connect import SQLITE_SYNCHRONOUS, open_store
from kvledger.ledger.store.limits import WRITER_BATCH_EVENTS_MAX
from kvledger.ledger.store.rows import INSERT_COLUMNS, encode_row
from kvledger.ledger.store.writer import BackgroundWriter
from kvledger.ledger.synth import SynthConfig, generate

PACE_EVENTS = 100
"""Appends between two looks at the clock when pacing."""


FIELDS: tuple[str, ...] = (
    "events",
    "batch",
    "synchronous",
    "store_rows_per_s",
    "raw_rows_per_s",
    "ratio",
    "store_rows_per_cpu_s",
    "raw_rows_per_cpu_s",
    "cpu_ratio",
    "append_rate_per_s",
    "append_p50_us",
    "append_p99_us",
    "append_max_us",
    "append_spilled",
    "burst_spilled",
)
"""Every field of the JSON line this benchmark ends with (tests/test_benchmarks_quick.py checks them)."""


def store_rows_per_s(events: list[Event], directory: Path, batch: int) -> float:
    store = open_store(str(directory / "store.db"), create=True)
    writer = BackgroundWriter(store, directory / "spill", queue_events_max=len(events), batch_events_max=batch)
    writer.start()
    started = time.perf_counter()
    put = writer.put
    for event in events:
        put(event)
    assert writer.close(timeout=600)
    elapsed = time.perf_counter() - started
    assert store.count() == len(events) and writer.stats()["spilled"] == 0
    store.close()
    return len(events) / elapsed


def raw_rows_per_s(events: list[Event], directory: Path, batch: int, ddl: list[str]) -> float:
    conn = sqlite3.connect(directory / "raw.db", isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute(f"PRAGMA synchronous = {SQLITE_SYNCHRONOUS}")
    for statement in ddl:
        conn.execute(statement)
    sql = f"INSERT INTO events ({', '.join(INSERT_COLUMNS)}) VALUES ({', '.join('?' * len(INSERT_COLUMNS))})"
    started = time.perf_counter()
    for i in range(0, len(events), batch):
        rows = [encode_row(e) for e in events[i : i + batch]]
        conn.execute("BEGIN")
        conn.executemany(sql, rows)
        conn.execute("COMMIT")
    elapsed = time.perf_counter() - started
    conn.close()
    return len(events) / elapsed


def events_ddl(directory: Path) -> list[str]:
    """The store's own CREATE statements for the events table and its indexes."""
    path = directory / "ddl.db"
    open_store(str(path), create=True).close()
    conn = sqlite3.connect(path)
    rows = conn.execute("SELECT sql FROM sqlite_master WHERE tbl_name = 'events' AND sql IS NOT NULL").fetchall()
    conn.close()
    return [sql for (sql,) in rows]


def append_latency_us(events: list[Event], directory: Path, rate: float | None) -> dict[str, float]:
    """EventLog.append latency with the writer subscribed, appending at `rate` events/s (None: all at once)."""
    directory.mkdir()
    store = open_store(str(directory / "latency.db"), create=True)
    writer = BackgroundWriter(store, directory / "spill-latency").start()
    logs: dict[str, EventLog] = {}
    samples: list[int] = []
    clock = time.perf_counter_ns
    started = time.perf_counter()
    for i, event in enumerate(events):
        if rate is not None and i % PACE_EVENTS == 0:
            # Sleep between appends (never inside a timed one) to hold the offered rate.
            time.sleep(max(0.0, started + i / rate - time.perf_counter()))
        log = logs.get(event.source)
        if log is None:
            log = logs[event.source] = EventLog(event.source)
            log.subscribe(writer.put)
        t0 = clock()
        log.append(event)
        samples.append(clock() - t0)
    assert writer.close(timeout=600)
    stats = writer.stats()
    store.close()
    samples.sort()
    return {
        "append_p50_us": samples[len(samples) // 2] / 1000,
        "append_p99_us": samples[int(len(samples) * 0.99)] / 1000,
        "append_max_us": samples[-1] / 1000,
        "append_spilled": stats["spilled"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=WRITER_BATCH_EVENTS_MAX)
    parser.add_argument("--load", type=float, default=0.5, help="Offered append rate, as a share of raw's")
    args = parse_args(parser, events=3_000, rounds=1)
    events = list(generate(SynthConfig(transfers=args.events // 6 + 1), seed=1))[: args.events]
    store_best = raw_best = 0.0
    per_cpu_s = {"raw": 0.0, "store": 0.0}
    with tempfile.TemporaryDirectory(prefix="kvledger-bench-") as tmp:
        ddl = events_ddl(Path(tmp))
        for round_ in range(args.rounds):
            # Alternate the order so neither side always gets the warmer cache.
            for name in ("raw", "store") if round_ % 2 == 0 else ("store", "raw"):
                directory = Path(tmp) / f"{name}-{round_}"
                directory.mkdir()
                cpu_started = time.process_time()
                if name == "raw":
                    rate = raw_rows_per_s(events, directory, args.batch, ddl)
                    raw_best = max(raw_best, rate)
                else:
                    rate = store_rows_per_s(events, directory, args.batch)
                    store_best = max(store_best, rate)
                per_cpu_s[name] = max(per_cpu_s[name], len(events) / (time.process_time() - cpu_started))
                print(f"round {round_ + 1}: {name:5s} {rate:,.0f} rows/s")
        rate = args.load * raw_best
        latency = append_latency_us(events, Path(tmp) / "latency", rate)
        burst = append_latency_us(events, Path(tmp) / "burst", None)
    print(f"store (batched writer): {store_best:,.0f} rows/s; raw sqlite3.executemany: {raw_best:,.0f} rows/s")
    print(f"append latency with the writer running: p50 {latency['append_p50_us']:.2f} us, "
          f"p99 {latency['append_p99_us']:.2f} us, max {latency['append_max_us']:.1f} us")  # fmt: skip
    result = {
        "events": len(events),
        "batch": args.batch,
        "synchronous": SQLITE_SYNCHRONOUS,
        "store_rows_per_s": round(store_best),
        "raw_rows_per_s": round(raw_best),
        "ratio": round(store_best / raw_best, 3),
        "store_rows_per_cpu_s": round(per_cpu_s["store"]),
        "raw_rows_per_cpu_s": round(per_cpu_s["raw"]),
        "cpu_ratio": round(per_cpu_s["store"] / per_cpu_s["raw"], 3),
        "append_rate_per_s": round(rate),
        **{k: round(v, 2) for k, v in latency.items()},
        "burst_spilled": burst["append_spilled"],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
