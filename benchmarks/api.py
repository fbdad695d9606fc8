"""The audit service under load: GET /audit latency over 1M events and 100k live transfers, and HTTP ingest.

Run: python benchmarks/api.py [--events 1000000] [--live 100000]. Builds a SQLite store (ledger.synth
traffic plus live maps, loaded with the store's batched append), serves it with uvicorn on loopback,
and ends with one JSON line. Baseline in the same run: one uncached `ledger.audit.audit()` call.
Then the service's start over a 1M-event store (benchmarks/ready.py): `ready_s_1m` from its snapshot, beside
`ready_s_1m_refold`, the baseline, folding the whole store.
"""

from __future__ import annotations

import argparse
import json
import statistics
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

from api.app import create_app
from api.settings import Settings
from benchmarks.ready import measure_ready_in_child
from ledger.audit import audit
from ledger.events import Event, Map, ReqId, TransferId
from ledger.store.connect import open_store
from ledger.synth import SynthConfig, generate

TOKEN = "bench"
LOAD_BATCH_EVENTS = 10_000
INGEST_BATCH_EVENTS = 1_000


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


def percentile(samples: list[float], p: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


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
    parser.add_argument("--ingest-batches", type=int, default=50)
    args = parser.parse_args()
    folder = tempfile.mkdtemp(prefix="kvledger-bench-")
    url = f"sqlite:///{folder}/ledger.db"
    now = time.time()
    load_s = build_store(url, args.events, args.live, now)
    print(f"store: {args.events} events ({args.live} live maps) appended in {load_s:.1f}s", file=sys.stderr)

    app = create_app(Settings(db=url, token=TOKEN, poll_interval_s=0.5))  # type: ignore[arg-type]
    server, thread, base, fold_s = start_server(app)
    live_state = app.state.live
    baseline_started = time.perf_counter()
    findings = audit(live_state.state, time.time(), live_state.audit_config)
    audit_uncached_ms = (time.perf_counter() - baseline_started) * 1000

    latencies: list[float] = []
    with httpx.Client(base_url=base, timeout=60) as client:
        summary = client.get("/audit/summary").json()
        for _ in range(args.requests):
            t0 = time.perf_counter()
            response = client.get("/audit")
            latencies.append((time.perf_counter() - t0) * 1000)
            assert response.status_code == 200
        side_seq = 0
        ingest_s = 0.0
        for b in range(args.ingest_batches):
            batch = [
                msgspec.to_builtins(m) | {"seq": side_seq + i + 1, "source": "ingest/tp0",
                                          "transfer_id": f"in-{b}-{i}"}
                for i, m in enumerate(live_maps(INGEST_BATCH_EVENTS, time.time()))
            ]  # fmt: skip
            side_seq += INGEST_BATCH_EVENTS
            t0 = time.perf_counter()
            response = client.post("/events", json={"events": batch}, headers={"Authorization": f"Bearer {TOKEN}"})
            ingest_s += time.perf_counter() - t0
            assert response.status_code == 200 and response.json()["inserted"] == INGEST_BATCH_EVENTS
    server.should_exit = True
    thread.join()
    ready = measure_ready_in_child()  # its own 1M-event store, whatever --events says
    result = {
        "events": args.events,
        "live_transfers": summary["live_transfers"],
        "findings": len(findings),
        "store_load_s": round(load_s, 1),
        "startup_fold_s": round(fold_s, 1),
        "audit_uncached_ms": round(audit_uncached_ms, 2),
        "audit_requests": len(latencies),
        "audit_p50_ms": round(statistics.median(latencies), 2),
        "audit_p99_ms": round(percentile(latencies, 99), 2),
        "audit_max_ms": round(max(latencies), 2),
        "ingest_events_per_s": round(args.ingest_batches * INGEST_BATCH_EVENTS / ingest_s),
        "ready_s_1m": ready["ready_s"],
        "ready_s_1m_refold": ready["ready_s_refold"],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
