"""The web page's time to first byte with 100k findings, against what an audit per request would cost.

Run: python benchmarks/page.py [--findings 100000] [--sources 8] [--events 200000] [--seconds 60]. Builds a
SQLite store (kvledger.ledger.synth traffic plus `--findings` producer sides whose deadlines passed ten minutes ago,
spread over `--sources` sources that stay live), serves it with uvicorn on loopback, and requests `GET /`
back to back for `--seconds` (long enough for the page's audit to be rebuilt in the background several
times while requests are served). Baselines in the same run: `GET /healthz` (the HTTP stack alone) and one
board build (the audit, grouping and plots a page that audited on each request would pay). Ends with one
JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from itertools import islice
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.api import LOAD_BATCH_EVENTS, percentile, start_server
from benchmarks.quick import parse_args
from kvledger.api.app import create_app
from kvledger.api.board import build
from kvledger.api.settings import Settings
from kvledger.ledger.events import Ack, Event, Map, ReqId, TransferId
from kvledger.ledger.store.connect import open_store
from kvledger.ledger.synth import SynthConfig, generate

TARGET_FIRST_BYTE_MS = 200.0
LEAKED_AGO_S = 600.0
"""The leaked sides were mapped this long before the run; their deadlines passed a minute later."""
TRANSFER_TIMEOUT_S = 3600.0
"""Long enough that no source falls silent during the run: every finding stays a leak on a live source."""
HEALTHZ_REQUESTS = 200


FIELDS: tuple[str, ...] = (
    "findings",
    "groups",
    "events",
    "store_load_s",
    "startup_s",
    "board_build_ms",
    "boards_built_during_run",
    "page_requests",
    "page_first_byte_p50_ms",
    "page_first_byte_p99_ms",
    "page_first_byte_max_ms",
    "healthz_first_byte_p50_ms",
    "page_p50_over_healthz",
    "build_over_page_p50",
    "target_first_byte_ms",
    "p99_under_target",
)
"""Every field of the JSON line this benchmark ends with (tests/test_benchmarks_quick.py checks them)."""


def leaked_sides(count: int, sources: int, now: float) -> list[Event]:
    """`count` producer sides, round-robin over `sources`, never decided; then one completed transfer per
    source just now, so each source is live (it writes) while it leaks."""
    seqs = [0] * sources
    events: list[Event] = []
    for i in range(count):
        k = i % sources
        seqs[k] += 1
        events.append(
            Map(seq=seqs[k], ts=now - LEAKED_AGO_S, source=f"prefill-{k + 10}/tp0",
                transfer_id=TransferId(f"leak-{i:07d}"), request_id=ReqId(f"p-leak-{i}"), role="producer",
                mode="read", block_ids=(2 * i, 2 * i + 1), deadline=now - LEAKED_AGO_S + 60.0)
        )  # fmt: skip
    for k in range(sources):
        source, tid = f"prefill-{k + 10}/tp0", TransferId(f"alive-{k}")
        events.append(Map(seq=seqs[k] + 1, ts=now, source=source, transfer_id=tid, request_id=ReqId(f"a-{k}"),
                          role="producer", mode="read", block_ids=(1 << 30,), deadline=now + 60.0))  # fmt: skip
        events.append(Ack(seq=seqs[k] + 2, ts=now, source=source, transfer_id=tid, what="release", rank=0))
    return events


def build_store(url: str, events_total: int, findings: int, sources: int) -> float:
    store = open_store(url, create=True)
    started = time.perf_counter()
    synth = generate(SynthConfig(transfers=events_total, concurrency=64, fault_rate=0.01), seed=7)
    remaining = events_total
    while remaining > 0:
        batch = list(islice(synth, min(LOAD_BATCH_EVENTS, remaining)))
        store.append(batch)
        remaining -= len(batch)
    leaks = leaked_sides(findings, sources, time.time())
    for first in range(0, len(leaks), LOAD_BATCH_EVENTS):
        store.append(leaks[first : first + LOAD_BATCH_EVENTS])
    store.close()
    return time.perf_counter() - started


def first_byte_ms(client: httpx.Client, path: str) -> float:
    started = time.perf_counter()
    with client.stream("GET", path) as response:
        assert response.status_code == 200, response.status_code
        chunks = response.iter_raw()
        next(chunks, b"")
        elapsed = time.perf_counter() - started
        for _ in chunks:
            pass
    return elapsed * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--findings", type=int, default=100_000)
    parser.add_argument("--sources", type=int, default=8)
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--seconds", type=float, default=60.0)
    args = parse_args(parser, findings=300, sources=2, events=2_000, seconds=1.0)
    folder = tempfile.mkdtemp(prefix="kvledger-page-bench-")
    url = f"sqlite:///{folder}/ledger.db"
    load_s = build_store(url, args.events, args.findings, args.sources)
    print(f"store: {args.events} synthetic events and {args.findings} leaked sides in {load_s:.1f}s", file=sys.stderr)

    app = create_app(Settings(db=url, transfer_timeout_s=TRANSFER_TIMEOUT_S))
    server, thread, base, startup_s = start_server(app)
    keeper = app.state.board
    board = keeper.board
    assert board is not None and board.findings_total >= args.findings, board and board.findings_total
    live = app.state.live
    baseline_started = time.perf_counter()
    build(live, time.time())  # what one page would cost if it audited on each request (no lock: nothing folds)
    build_ms = (time.perf_counter() - baseline_started) * 1000

    builds_seen: set[float] = {board.built_at}
    page_ms: list[float] = []
    with httpx.Client(base_url=base, timeout=60) as client:
        healthz_ms = [first_byte_ms(client, "/healthz") for _ in range(HEALTHZ_REQUESTS)]
        deadline = time.perf_counter() + args.seconds
        while time.perf_counter() < deadline:
            page_ms.append(first_byte_ms(client, "/"))
            if keeper.board is not None:
                builds_seen.add(keeper.board.built_at)
        body = client.get("/").text
    server.should_exit = True
    thread.join()
    assert f"{args.findings:,}" in body, "the page shows the leaks' count"
    p99 = percentile(page_ms, 99)
    result = {
        "findings": keeper.board.findings_total if keeper.board is not None else None,
        "groups": len(keeper.board.groups) if keeper.board is not None else None,
        "events": args.events + args.findings + 2 * args.sources,
        "store_load_s": round(load_s, 1),
        "startup_s": round(startup_s, 1),
        "board_build_ms": round(build_ms, 1),
        "boards_built_during_run": len(builds_seen) - 1,
        "page_requests": len(page_ms),
        "page_first_byte_p50_ms": round(statistics.median(page_ms), 2),
        "page_first_byte_p99_ms": round(p99, 2),
        "page_first_byte_max_ms": round(max(page_ms), 2),
        "healthz_first_byte_p50_ms": round(statistics.median(healthz_ms), 2),
        "page_p50_over_healthz": round(statistics.median(page_ms) / statistics.median(healthz_ms), 1),
        "build_over_page_p50": round(build_ms / statistics.median(page_ms), 1),
        "target_first_byte_ms": TARGET_FIRST_BYTE_MS,
        "p99_under_target": p99 < TARGET_FIRST_BYTE_MS,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
