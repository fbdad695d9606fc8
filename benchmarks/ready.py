"""Service start over a 1M-event SQLite store: ready from its newest snapshot, against folding the whole store.

Run: python benchmarks/ready.py [--events 1000000] [--tail 50000] (benchmarks/api.py reports the same figures
as `ready_s_1m` and `ready_s_1m_refold`). The store is written with raw sqlite3 executemany of the store's
own rows (kvledger.ledger.synth traffic). Ready is the time from `create_app` until uvicorn has started (the app's
startup, which folds the store, is done) and GET /healthz has answered, imports excluded.

1. a service folds the first `events - tail` events from zero and writes its snapshot in the background
   (how long the fold waits while it is copied is reported: `snapshot_lock_s`);
2. `tail` more events are appended; a service starts from the snapshot and folds only them (`ready_s`);
3. the baseline in the same run: a service over the same store with snapshots not read (`ready_s_refold`).
Each start runs in a process of its own (`--start`), as a service's start does: in the process that wrote
the snapshot, that service's million-event fold stayed in the heap, and the garbage collector's passes and
the memory it took were part of what was timed. Both states are checked equal (a digest of their encoding).
`ready_cpu_s*` are the CPU seconds the process spent meanwhile: on a machine whose cores other work shares,
the wall times stretch and these do not. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from itertools import islice
from pathlib import Path
from typing import Any

import httpx
import uvicorn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.quick import parse_args
from kvledger.api.app import create_app
from kvledger.api.live import Live
from kvledger.api.settings import Settings
from kvledger.ledger.events import Event
from kvledger.ledger.store import snapshot
from kvledger.ledger.store.connect import open_store
from kvledger.ledger.store.rows import INSERT_COLUMNS, encode_rows
from kvledger.ledger.synth import SynthConfig, generate

WRITE_BATCH_ROWS = 100_000
SNAPSHOT_POLLS_MAX = 6_000
"""Waits of 0.1 s for the first service's background snapshot (it encodes a million events' fold)."""


FIELDS: tuple[str, ...] = (
    "events",
    "tail_events",
    "store_build_s",
    "ready_s",
    "ready_s_refold",
    "ready_cpu_s",
    "ready_cpu_s_refold",
    "snapshot_bytes",
    "snapshot_lock_s",
    "snapshot_encode_cpu_s",
    "snapshot_save_s",
)
"""Every field of the JSON line this benchmark ends with (tests/test_benchmarks_quick.py checks them)."""


def append_raw(path: Path, events: list[Event]) -> None:
    """The store's own rows written with raw executemany (the fastest way to a large store)."""
    marks = ", ".join("?" * len(INSERT_COLUMNS))
    with sqlite3.connect(path) as conn:
        for first in range(0, len(events), WRITE_BATCH_ROWS):
            conn.executemany(
                f"INSERT INTO events ({', '.join(INSERT_COLUMNS)}) VALUES ({marks})",
                encode_rows(events[first : first + WRITE_BATCH_ROWS]),
            )
    conn.close()


class Started:
    """A service serving `settings` on loopback in a thread, and how long it took to be ready."""

    def __init__(self, settings: Settings) -> None:
        self.app = create_app(settings)
        started, cpu_started = time.perf_counter(), time.process_time()
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the service did not start")
            time.sleep(0.005)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=30).status_code == 200
        self.ready_s = time.perf_counter() - started
        self.ready_cpu_s = time.process_time() - cpu_started
        """CPU seconds of the whole process (every thread) meanwhile: the start's own cost on a busy machine."""

    @property
    def live(self) -> Live:
        live: Live = self.app.state.live
        return live

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join()


def measure_ready(events_total: int = 1_000_000, tail: int = 50_000) -> dict[str, float | int]:
    """`ready_s` (from a snapshot, `tail` events after it) and `ready_s_refold` over one `events_total` store."""
    folder = Path(tempfile.mkdtemp(prefix="kvledger-ready-"))
    try:
        return _measure_ready(folder / "ledger.db", events_total, tail)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _measure_ready(path: Path, events_total: int, tail: int) -> dict[str, float | int]:
    url = f"sqlite:///{path}"
    open_store(url, create=True).close()
    synth = generate(SynthConfig(transfers=events_total, concurrency=64, fault_rate=0.01), seed=11)
    started = time.perf_counter()
    append_raw(path, list(islice(synth, events_total - tail)))
    build_s = time.perf_counter() - started

    first = Started(Settings(db=url, snapshot_every_events=1))
    for _ in range(SNAPSHOT_POLLS_MAX):
        if first.live.snapshot_written is not None:
            break
        time.sleep(0.1)
    written = first.live.snapshot_written
    first.stop()
    assert written is not None, "the service wrote no snapshot"

    append_raw(path, list(islice(synth, tail)))
    fast = _start_in_child(url, snapshots_read=True)
    refold = _start_in_child(url, snapshots_read=False)
    assert fast["restored_from"] == written.cursor and refold["restored_from"] is None
    assert fast["rows_folded"] == refold["rows_folded"] == events_total
    assert fast["state_digest"] == refold["state_digest"], "the two starts differ"
    return {
        "events": events_total,
        "tail_events": tail,
        "store_build_s": round(build_s, 1),
        "ready_s": fast["ready_s"],
        "ready_s_refold": refold["ready_s"],
        "ready_cpu_s": fast["ready_cpu_s"],
        "ready_cpu_s_refold": refold["ready_cpu_s"],
        "snapshot_bytes": written.bytes,
        "snapshot_lock_s": round(written.lock_s, 2),
        "snapshot_encode_cpu_s": round(written.encode_cpu_s, 2),
        "snapshot_save_s": round(written.save_s, 2),
    }


def measure_start(url: str, snapshots_read: bool) -> dict[str, object]:
    """One service start over `url` in this process: how long until ready, and what it folded."""
    started = Started(Settings(db=url, snapshot_every_events=0, snapshots_read=snapshots_read))
    live = started.live
    out: dict[str, object] = {
        "ready_s": round(started.ready_s, 2),
        "ready_cpu_s": round(started.ready_cpu_s, 2),
        "restored_from": live.restored_from,
        "rows_folded": live.rows_folded,
        "state_digest": hashlib.blake2b(snapshot.encode(live.state)).hexdigest(),
    }
    started.stop()
    return out


def _start_in_child(url: str, snapshots_read: bool) -> dict[str, Any]:
    argv = [sys.executable, __file__, "--start", url, *([] if snapshots_read else ["--refold"])]
    done = subprocess.run(argv, capture_output=True, text=True, check=True)
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def measure_ready_in_child(events_total: int = 1_000_000, tail: int = 50_000) -> dict[str, float | int]:
    """`measure_ready` in a process of its own: a caller's heap (another benchmark's million-event fold)
    would otherwise be walked by each start's garbage collection and be part of what is timed."""
    argv = [sys.executable, __file__, "--events", str(events_total), "--tail", str(tail)]
    done = subprocess.run(argv, capture_output=True, text=True, check=True)
    result: dict[str, float | int] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--tail", type=int, default=50_000)
    parser.add_argument("--start", metavar="URL", help="only one service start over this store (a child's part)")
    parser.add_argument("--refold", action="store_true", help="with --start: snapshots not read")
    args = parse_args(parser, events=3_000, tail=500)
    if args.start:
        print(json.dumps(measure_start(args.start, snapshots_read=not args.refold)))
        return
    print(json.dumps(measure_ready(args.events, args.tail)))


if __name__ == "__main__":
    main()
