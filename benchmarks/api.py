"""The audit service under load: GET /audit latency over 1M events and 100k live transfers, and HTTP ingest.

Run: python benchmarks/api.py [--events 1000000] [--live 100000] [--pg-url URL] [--only ingest|reads]. Builds a
SQLite store (kvledger.ledger.synth traffic plus live maps, loaded with the store's batched append), serves it with
uvicorn on loopback, and ends with one JSON line. Baselines in the same run: one uncached
`kvledger.ledger.audit.audit()` call, and for ingest raw `executemany` of the same events' rows in the same
batches (sqlite3 into a table made from the store's DDL; psycopg into a store of its own). Ingest into PostgreSQL
goes to a schema of its own (a store prefilled with --pg-events), dropped at the end; --pg-url '' skips it.
Ingested maps name blocks no live transfer holds (an engine maps free blocks): a batch re-mapping held
blocks would measure the fold's double-claim path instead. Ingest is posted as engines post it: from client
processes of their own (--ingest-clients, one source each, every client's batches in seq order), all at
once; the figure is the events stored over the wall time from the first request to the last answer (in
the service's process, a client would share its GIL and time the client's work as the service's). Ingest
starts once the snapshot a start writes over the store it folded is stored (`start_snapshot_wait_s`): while
one is encoded (3-4 CPU seconds for a million events' fold, in a forked child) it takes a core from ingest. The
1,000,000 events posted (--ingest-batches) double the fold and are past the service's snapshot cadence (every
100,000 events, at most once per ten times the last one's cost: `kvledger.api.snapshots.due`) and the collector's
full passes, so the figure is sustained ingest with the snapshots and collections it brings, not a window
short enough to miss them. 50 batches hid that a million events' fold was snapshotted every 2 s (a third of
the rate over 200 batches); 200 batches ended before the collector's first full pass and hid that it walked
the fold's million-entry containers (a third of the CPU over 1,000 batches: `ingest_collector_s`, the
collector's seconds in the service's process while the batches were posted).
Reads while the service writes (`reads_while_writing`): GET /audit from a reader process of its own, one request
every --read-interval-ms, while a snapshot of the whole fold is written (`*_snapshot`) and while
--read-ingest-batches are posted as above (`*_ingesting`): p99 and max, beside the same reader's while the
service does nothing else (`*_idle`: what the machine and the reader add). Over SQLite at --events before the
ingest figure is measured; over PostgreSQL after its ingest (`events_postgres` folded). `--only reads`: these and
the first figures (`audit_p50_ms` etc.: requests from this process right after the start) alone.
Then the service's start over a 1M-event store (benchmarks/ready.py): `ready_s_1m` from its snapshot, beside
`ready_s_1m_refold`, the baseline, folding the whole store.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from itertools import islice
from pathlib import Path

import httpx
import msgspec
import uvicorn
from fastapi import FastAPI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.quick import parse_args
from benchmarks.ready import measure_ready_in_child
from benchmarks.store import events_ddl, raw_rows_per_s
from kvledger.api import snapshots
from kvledger.api.app import create_app
from kvledger.api.settings import Settings
from kvledger.ledger.audit import audit
from kvledger.ledger.events import Event, Map, ReqId, TransferId
from kvledger.ledger.store.connect import open_store
from kvledger.ledger.store.rows import INSERT_COLUMNS, encode_row
from kvledger.ledger.store.url import parse_url
from kvledger.ledger.synth import SynthConfig, generate

TOKEN = "bench"
LOAD_BATCH_EVENTS = 10_000
INGEST_BATCH_EVENTS = 1_000
INGEST_SOURCE = "ingest/tp0"
PG_URL = os.environ.get("KVLEDGER_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


FIELDS: tuple[str, ...] = (
    "events",
    "live_transfers",
    "findings",
    "store_load_s",
    "startup_fold_s",
    "audit_uncached_ms",
    "audit_requests",
    "audit_p50_ms",
    "audit_p99_ms",
    "audit_max_ms",
    "audit_requests_idle",
    "audit_p99_ms_idle",
    "audit_max_ms_idle",
    "audit_requests_snapshot",
    "snapshot_write_s",
    "snapshot_lock_ms",
    "audit_p99_ms_snapshot",
    "audit_max_ms_snapshot",
    "audit_requests_ingesting",
    "audit_p99_ms_ingesting",
    "audit_max_ms_ingesting",
    "ingest_clients",
    "start_snapshot_wait_s",
    "ingest_events_per_s",
    "ingest_raw_events_per_s",
    "ingest_collector_s",
    "ingest_events_per_s_postgres",
    "ingest_raw_events_per_s_postgres",
    "ingest_collector_s_postgres",
    "events_postgres",
    "audit_requests_idle_postgres",
    "audit_p99_ms_idle_postgres",
    "audit_max_ms_idle_postgres",
    "audit_requests_snapshot_postgres",
    "snapshot_write_s_postgres",
    "snapshot_lock_ms_postgres",
    "audit_p99_ms_snapshot_postgres",
    "audit_max_ms_snapshot_postgres",
    "audit_requests_ingesting_postgres",
    "audit_p99_ms_ingesting_postgres",
    "audit_max_ms_ingesting_postgres",
    "ready_s_1m",
    "ready_s_1m_refold",
)
"""Every field of the JSON line this benchmark ends with (tests/test_benchmarks_quick.py checks them)."""


def live_maps(count: int, now: float) -> list[Event]:
    """`count` producer maps with no further events: blocks held, deadlines an hour ahead."""
    return [
        Map(seq=i + 1, ts=now, source="prefill-9/tp0", transfer_id=TransferId(f"live-{i:07d}"),
            request_id=ReqId(f"p-live-{i}"), role="producer", mode="read",
            block_ids=(4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3), deadline=now + 3600.0)
        for i in range(count)
    ]  # fmt: skip


def build_store(url: str, events_total: int, live: int, now: float) -> float:
    store = open_store(url, create=True)
    started = time.perf_counter()
    synth = generate(SynthConfig(transfers=events_total, concurrency=64, fault_rate=0.01), seed=7)
    remaining = events_total - live
    while remaining > 0:
        batch = list(islice(synth, min(LOAD_BATCH_EVENTS, remaining)))
        store.append(batch)
        remaining -= len(batch)
    maps = live_maps(live, now)
    for first in range(0, live, LOAD_BATCH_EVENTS):
        store.append(maps[first : first + LOAD_BATCH_EVENTS])
    store.close()
    return time.perf_counter() - started


def ingest_batches(count: int, now: float, source: str = INGEST_SOURCE) -> list[list[Event]]:
    """`count` batches of live maps from `source`, seqs following on, each naming blocks of its own."""
    batches: list[list[Event]] = []
    for b in range(count):
        first = b * INGEST_BATCH_EVENTS
        batches.append([
            Map(seq=first + i + 1, ts=now, source=source, transfer_id=TransferId(f"in-{b}-{i}"),
                request_id=ReqId(f"p-in-{b}-{i}"), role="producer", mode="read",
                block_ids=tuple(range(4 * (first + i), 4 * (first + i) + 4)), deadline=now + 3600.0)
            for i in range(INGEST_BATCH_EVENTS)
        ])  # fmt: skip
    return batches


def ingest_sources(clients: int) -> list[str]:
    return [f"{INGEST_SOURCE.split('/')[0]}-{c}/tp0" for c in range(clients)]


def ingest_events_per_s(
    base: str, batches_by_source: list[list[list[Event]]], reader: Reader | None = None
) -> tuple[float, list[float]]:
    """POST /events of each source's batches (encoded beforehand), each source from a client process of its
    own, all started at once: events stored per second of wall time, first request to last answer; and the
    latencies `reader` timed from the clients' start to their last answer (none without one)."""
    folder = Path(tempfile.mkdtemp(prefix="kvledger-ingest-"))
    clients: list[subprocess.Popen[str]] = []
    try:
        for c, batches in enumerate(batches_by_source):
            bodies = folder / f"client-{c}.jsonl"
            bodies.write_bytes(b"".join(msgspec.json.encode({"events": batch}) + b"\n" for batch in batches))
            command = [sys.executable, str(Path(__file__).resolve()), "--post-client", base, str(bodies)]
            clients.append(subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        for client in clients:  # each has read its bodies and opened its connection
            assert client.stdout is not None and client.stdout.readline().strip() == "ready"
        if reader is not None:
            reader.start()
        for client in clients:
            assert client.stdin is not None
            client.stdin.write("go\n")
            client.stdin.flush()
        answers = [json.loads(client.communicate()[0].splitlines()[-1]) for client in clients]
        latencies = reader.stop() if reader is not None else []
    finally:
        for client in clients:
            if client.poll() is None:
                client.kill()
        for path in folder.iterdir():
            path.unlink()
        folder.rmdir()
    expected = sum(len(batch) for batches in batches_by_source for batch in batches)
    assert sum(a["inserted"] for a in answers) == expected, answers
    return expected / float(max(a["end"] for a in answers) - min(a["start"] for a in answers)), latencies


class CollectorClock:
    """Seconds the garbage collector ran in this process (the service's, which the server's thread is in)
    between entering and leaving the block, by the collector's own start and stop callbacks."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._started = 0.0

    def _callback(self, phase: str, _info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._started

    def __enter__(self) -> CollectorClock:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *_: object) -> None:
        gc.callbacks.remove(self._callback)


class Reader:
    """A client process of its own (`read_client`) sending GET /audit every `interval_ms` from `start` until
    `stop`, which returns each request's milliseconds: the service's read latency while something else runs
    (a reader in this process would share the service's GIL and time its own work as the service's)."""

    def __init__(self, base: str, interval_ms: float) -> None:
        command = [sys.executable, str(Path(__file__).resolve()), "--read-client", base, str(interval_ms)]
        self._process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def __enter__(self) -> Reader:
        assert self._process.stdout is not None and self._process.stdout.readline().strip() == "ready"
        return self

    def start(self) -> None:
        assert self._process.stdin is not None
        self._process.stdin.write("go\n")
        self._process.stdin.flush()
        assert self._process.stdout is not None and self._process.stdout.readline().strip() == "going"

    def stop(self) -> list[float]:
        out = self._process.communicate("stop\n", timeout=120)[0]
        latencies: list[float] = json.loads(out.splitlines()[-1])
        return latencies

    def __exit__(self, *_: object) -> None:
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait()


def _set_on_a_line(event: threading.Event) -> None:
    sys.stdin.readline()
    event.set()


def read_client(base: str, interval_ms: str) -> None:
    """A reader process (see `Reader`): at least one GET /audit after "go", then one every `interval_ms` until
    "stop"; prints the latencies (ms) as one JSON list."""
    interval_s = float(interval_ms) / 1000
    stopped = threading.Event()
    latencies: list[float] = []
    with httpx.Client(base_url=base, timeout=120) as client:
        client.get("/healthz")
        print("ready", flush=True)
        sys.stdin.readline()
        threading.Thread(target=_set_on_a_line, args=(stopped,), daemon=True).start()
        print("going", flush=True)
        while True:
            started = time.perf_counter()
            response = client.get("/audit")
            latencies.append((time.perf_counter() - started) * 1000)
            assert response.status_code == 200, response.text
            if stopped.wait(max(0.0, interval_s - (time.perf_counter() - started))):
                break
    print(json.dumps(latencies), flush=True)


def write_snapshot(app: FastAPI, loop: asyncio.AbstractEventLoop) -> tuple[float, float]:
    """A snapshot of the service's fold written now, on its event loop: (seconds until it was stored, seconds
    the fold lock was held for it)."""
    started = time.perf_counter()
    written = asyncio.run_coroutine_threadsafe(snapshots.write(app.state.live), loop).result(timeout=600)
    assert written is not None
    return time.perf_counter() - started, written.lock_s


def service_settings(url: str) -> Settings:
    """The benchmark's service over `url`. The live maps stay live, never stuck, for the whole run however slow
    the machine: their deadlines are an hour out and so is the transfer timeout (at the default 30 s they
    turned stuck during a run, and the audit had 100k findings in one run and 368 in the next)."""
    return Settings(db=url, token=TOKEN, poll_interval_s=0.5, transfer_timeout_s=3600.0)  # type: ignore[arg-type]


def latency_figures(latencies: list[float], suffix: str) -> dict[str, float | int]:
    return {
        f"audit_requests_{suffix}": len(latencies),
        f"audit_p99_ms_{suffix}": round(percentile(latencies, 99), 2),
        f"audit_max_ms_{suffix}": round(max(latencies), 2),
    }


def post_client(base: str, bodies_path: str) -> None:
    """A client process: post each line of `bodies_path` to POST /events in order once told to go, then
    print when it started and ended (wall clock, comparable across processes) and how many were stored."""
    bodies = Path(bodies_path).read_bytes().splitlines()
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    with httpx.Client(base_url=base, timeout=120) as client:
        client.get("/healthz")
        print("ready", flush=True)
        sys.stdin.readline()
        inserted = 0
        start = time.time()
        for body in bodies:
            response = client.post("/events", content=body, headers=headers)
            assert response.status_code == 200, response.text
            inserted += response.json()["inserted"]
        end = time.time()
    print(json.dumps({"start": start, "end": end, "inserted": inserted}), flush=True)


def raw_pg_rows_per_s(pg_url: str, batches: list[list[Event]]) -> float:
    """The baseline: psycopg's executemany of the same rows, a transaction per batch, into the table a store
    of its own made (same indexes)."""
    import psycopg

    store_url = parse_url(pg_url)
    assert store_url.url is not None and store_url.schema
    open_store(pg_url, create=True).close()
    columns = ", ".join(INSERT_COLUMNS)
    sql = f"INSERT INTO {store_url.schema}.events ({columns}) VALUES ({', '.join(['%s'] * len(INSERT_COLUMNS))})"
    dsn = store_url.url.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(dsn) as conn:
        started = time.perf_counter()
        for batch in batches:
            rows = [encode_row(e) for e in batch]
            with conn.transaction(), conn.cursor() as cursor:
                cursor.executemany(sql, rows)
        elapsed = time.perf_counter() - started
    return sum(map(len, batches)) / elapsed


def pg_ingest(
    pg_url: str, prefill: int, batches_by_source: list[list[list[Event]]], reads: argparse.Namespace | None = None
) -> dict[str, float | int]:
    """Ingest into a PostgreSQL store of its own (prefilled), and the raw baseline; both schemas dropped. With
    `reads` (the arguments), then `reads_while_writing` over that store (the prefill and what was ingested)."""
    import psycopg

    tag = f"kvl_bench_{os.getpid()}"
    schemas = [f"{tag}_store", f"{tag}_raw"]
    admin = parse_url(pg_url).url
    assert admin is not None
    dsn = admin.set(drivername="postgresql").render_as_string(hide_password=False)
    try:
        url = f"{pg_url}?schema={schemas[0]}"
        build_store(url, prefill, 0, time.time())
        app = create_app(service_settings(url))
        server, thread, base, _ = start_server(app)
        try:
            snapshot_settled(app)
            with CollectorClock() as collector:
                served = ingest_events_per_s(base, batches_by_source)[0]
            events_read = app.state.live.rows_folded
            read_figures = {} if reads is None else reads_while_writing(reads, app, server, base, time.time())
        finally:
            server.should_exit = True
            thread.join()
        raw = raw_pg_rows_per_s(f"{pg_url}?schema={schemas[1]}", [b for batches in batches_by_source for b in batches])
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            for schema in schemas:
                conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    return {"ingest_events_per_s_postgres": round(served), "ingest_raw_events_per_s_postgres": round(raw),
            "ingest_collector_s_postgres": round(collector.seconds, 2),
            **({"events_postgres": events_read} if reads is not None else {}),
            **{f"{name}_postgres": value for name, value in read_figures.items()}}  # fmt: skip


def snapshot_settled(app: FastAPI, timeout_s: float = 300.0) -> float:
    """Wait until the service has no snapshot due (the one its start writes is stored): seconds waited."""
    live, started = app.state.live, time.perf_counter()
    every = live.settings.snapshot_every_events
    while every and live.rows_folded - live.snapshot_rows >= every:
        if time.perf_counter() - started > timeout_s:
            raise TimeoutError(f"no snapshot written in {timeout_s} s")
        time.sleep(0.05)
    return time.perf_counter() - started


def percentile(samples: list[float], p: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


def server_loop(server: uvicorn.Server) -> asyncio.AbstractEventLoop:
    """The event loop `server` (started by `start_server`) serves on."""
    return server.servers[0].get_loop()


def start_server(app: FastAPI) -> tuple[uvicorn.Server, threading.Thread, str, float]:
    """uvicorn serving `app` on a free loopback port in a thread: (server, thread, base URL, startup seconds)."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    started = time.perf_counter()
    thread.start()
    while not server.started:
        time.sleep(0.05)
    base = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    return server, thread, base, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--live", type=int, default=100_000)
    parser.add_argument("--requests", type=int, default=2_000)
    parser.add_argument(
        "--ingest-batches", type=int, default=1000, help="1,000-event batches in all (past the snapshot cadence)"
    )
    parser.add_argument("--ingest-clients", type=int, default=2, help="client processes posting, a source each")
    parser.add_argument(
        "--read-ingest-batches", type=int, default=300, help="1,000-event batches posted while GET /audit is timed"
    )
    parser.add_argument("--read-interval-ms", type=float, default=10.0, help="GET /audit this often while timed")
    parser.add_argument("--read-idle-s", type=float, default=5.0, help="GET /audit timed this long with no writes")
    parser.add_argument("--post-client", nargs=2, metavar=("BASE", "BODIES"), help=argparse.SUPPRESS)
    parser.add_argument("--read-client", nargs=2, metavar=("BASE", "INTERVAL_MS"), help=argparse.SUPPRESS)
    parser.add_argument("--pg-url", default=PG_URL, help="PostgreSQL for the ingest figure ('' to skip)")
    parser.add_argument("--pg-events", type=int, default=100_000, help="Events in the PostgreSQL store first")
    parser.add_argument(
        "--only",
        choices=("all", "ingest", "reads"),
        default="all",
        help="ingest: only the ingest figures (no audit, no ready); reads: only the audit figures",
    )
    args = parse_args(
        parser,
        events=3_000,
        live=300,
        requests=20,
        ingest_batches=4,
        read_ingest_batches=4,
        read_idle_s=0.1,
        pg_events=1_000,
    )
    if args.post_client:
        post_client(*args.post_client)
        return
    if args.read_client:
        read_client(*args.read_client)
        return
    # First, while this process holds nothing: its own 1M-event store, whatever --events says. Measured after
    # the rest, the child's start ran beside this process's million-event fold and took a second more.
    ready = {} if args.only != "all" else measure_ready_in_child()
    folder = tempfile.mkdtemp(prefix="kvledger-bench-")
    try:
        print(json.dumps(measure(args, folder, ready)))
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # the 1M-event store: 840 MB a run, left behind before


def reads_while_writing(
    args: argparse.Namespace, app: FastAPI, server: uvicorn.Server, base: str, now: float
) -> dict[str, float | int]:
    """GET /audit latency from a reader process while a snapshot of the whole fold is written (on the
    service's loop, as its background writer does), then while `--read-ingest-batches` are posted as
    ingest posts them (sources of their own); the baseline, the same reader while the service does nothing else
    (`*_idle`, --read-idle-s): what the machine and the reader add."""
    with Reader(base, args.read_interval_ms) as reader:
        reader.start()
        time.sleep(args.read_idle_s)
        idle = reader.stop()
    with Reader(base, args.read_interval_ms) as reader:
        reader.start()
        write_s, lock_s = write_snapshot(app, server_loop(server))
        during_snapshot = reader.stop()
    per_client = max(1, args.read_ingest_batches // args.ingest_clients)
    sources = [f"reads-{c}/tp0" for c in range(args.ingest_clients)]
    by_source = [ingest_batches(per_client, now, source) for source in sources]
    with Reader(base, args.read_interval_ms) as reader:
        during_ingest = ingest_events_per_s(base, by_source, reader)[1]
    return {
        **latency_figures(idle, "idle"),
        **latency_figures(during_snapshot, "snapshot"),
        "snapshot_write_s": round(write_s, 2),
        "snapshot_lock_ms": round(lock_s * 1000, 1),
        **latency_figures(during_ingest, "ingesting"),
    }


def uncached_audit(app: FastAPI) -> tuple[float, int]:
    """The baseline: one `audit()` of the service's fold, as a request would pay it uncached (ms, findings)."""
    live = app.state.live
    started = time.perf_counter()
    findings = audit(live.state, time.time(), live.audit_config)
    return (time.perf_counter() - started) * 1000, len(findings)


def measure(args: argparse.Namespace, folder: str, ready: dict[str, float | int]) -> dict[str, object]:
    """Every figure but `ready_s_1m*` (`ready`, measured first), over a store in `folder`."""
    only_ingest = args.only == "ingest"
    url = f"sqlite:///{folder}/ledger.db"
    now = time.time()
    load_s = build_store(url, args.events, args.live, now)
    print(f"store: {args.events} events ({args.live} live maps) appended in {load_s:.1f}s", file=sys.stderr)

    app = create_app(service_settings(url))
    server, thread, base, fold_s = start_server(app)
    audit_uncached_ms, findings = uncached_audit(app)

    latencies: list[float] = []
    with httpx.Client(base_url=base, timeout=60) as client:
        summary = client.get("/audit/summary").json()
        for _ in range(0 if only_ingest else args.requests):
            t0 = time.perf_counter()
            response = client.get("/audit")
            latencies.append((time.perf_counter() - t0) * 1000)
            assert response.status_code == 200
    now = time.time()
    start_snapshot_wait_s = snapshot_settled(app)
    reads = {} if only_ingest else reads_while_writing(args, app, server, base, now)
    audit_figures = {
        "events": args.events,
        "live_transfers": summary["live_transfers"],
        "findings": findings,
        "store_load_s": round(load_s, 1),
        "startup_fold_s": round(fold_s, 1),
        "audit_uncached_ms": round(audit_uncached_ms, 2),
        "audit_requests": len(latencies),
        "audit_p50_ms": round(statistics.median(latencies), 2) if latencies else None,
        "audit_p99_ms": round(percentile(latencies, 99), 2) if latencies else None,
        "audit_max_ms": round(max(latencies), 2) if latencies else None,
        **reads,
    }
    if args.only == "reads":
        server.should_exit = True
        thread.join()
        return audit_figures
    per_client = max(1, args.ingest_batches // args.ingest_clients)
    by_source = [ingest_batches(per_client, now, source) for source in ingest_sources(args.ingest_clients)]
    batches = [batch for batches in by_source for batch in batches]
    snapshot_settled(app)  # the snapshots the reads' ingest brought
    with CollectorClock() as collector:
        ingest = ingest_events_per_s(base, by_source)[0]
    server.should_exit = True
    thread.join()
    del app, server, thread
    gc.collect()  # the stopped service's fold: the PostgreSQL phase's service shares this process with none of it
    raw_dir = Path(folder) / "raw"
    raw_dir.mkdir()
    raw_ingest = raw_rows_per_s([e for b in batches for e in b], raw_dir, INGEST_BATCH_EVENTS, events_ddl(raw_dir))
    reads_too = None if args.only == "ingest" else args
    postgres = pg_ingest(args.pg_url, args.pg_events, by_source, reads_too) if args.pg_url else {}
    if only_ingest:
        return {"events": args.events, "ingest_clients": args.ingest_clients,
                "start_snapshot_wait_s": round(start_snapshot_wait_s, 1),
                "ingest_events_per_s": round(ingest), "ingest_raw_events_per_s": round(raw_ingest),
                "ingest_collector_s": round(collector.seconds, 2), **postgres}  # fmt: skip
    return {
        **audit_figures,
        "ingest_clients": args.ingest_clients,
        "start_snapshot_wait_s": round(start_snapshot_wait_s, 1),
        "ingest_events_per_s": round(ingest),
        "ingest_raw_events_per_s": round(raw_ingest),
        "ingest_collector_s": round(collector.seconds, 2),
        **postgres,
        "ready_s_1m": ready["ready_s"],
        "ready_s_1m_refold": ready["ready_s_refold"],
    }


if __name__ == "__main__":
    main()
