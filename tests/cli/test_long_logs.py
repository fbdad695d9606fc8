"""Findings do not depend on a log's length: the issue's two cases, through the real `kvledger replay`.

Each incident is written once alone and once followed by minutes of ordinary traffic (many replay
retention windows, so the sides that prove the finding are compacted long before the end)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

from kvledger.ledger.events import Event
from kvledger.ledger.jsonl import write_log
from tests.ledger.builders import Side

KVLEDGER = shutil.which("kvledger") or "kvledger"
TRAFFIC_S = 3600.0
TRAFFIC_STEP_S = 0.5
"""An hour of clean READ transfers, two a second: 28,800 events, sixty replay retention windows and
more than one compaction pass (every REPLAY_COMPACT_EVERY events)."""


def _traffic(p: Side, c: Side, start: float) -> list[Event]:
    events: list[Event] = []
    ts, i = start, 0
    while ts < start + TRAFFIC_S:
        tid = f"tx-bg-{i}"
        events += [
            p.map(tid, f"p-bg-{i}", blocks=(100 + i % 50,), ts=ts),
            c.map(tid, f"c-bg-{i}", "consumer", remote=(100 + i % 50,), blocks=(200 + i % 50,), ts=ts + 0.1),
            c.ack(tid, "read", ts=ts + 0.2),
            p.ack(tid, "release", ts=ts + 0.3),
        ]
        ts, i = ts + TRAFFIC_STEP_S, i + 1
    return events


def _replay(tmp_path: Path, name: str, events: list[Event]) -> dict[str, Any]:
    path = tmp_path / f"{name}.jsonl"
    write_log(path, sorted(events, key=lambda e: e.ts))
    run = subprocess.run(
        [KVLEDGER, "replay", str(path), "--json", "--fail-on", "never"], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    document: dict[str, Any] = json.loads(run.stdout)
    return document


def _codes(document: dict[str, Any], tid: str) -> list[str]:
    return sorted(f["code"] for f in document["findings"] if f["transfer_id"] == tid)


def test_a_premature_release_is_found_however_much_traffic_follows(tmp_path: Path) -> None:
    p, c = Side("prefill-0/tp0", start_ts=1000.0), Side("decode-0/tp0", start_ts=1000.0)
    incident = [
        p.map("tx-bad", "p-1", blocks=(1, 2), deadline=1001.0, ts=1000.0),
        c.map("tx-bad", "c-1", "consumer", remote=(1, 2), blocks=(8, 9), ts=1000.1),
        c.schedule("tx-bad", ts=1000.2),
        p.expire("tx-bad", ts=1001.0),  # the producer frees its blocks...
        c.ack("tx-bad", "read", ts=1005.0),  # ...and the consumer's read of them finishes later
    ]
    short = _replay(tmp_path, "short", incident)
    long = _replay(tmp_path, "long", incident + _traffic(p, c, start=1010.0))
    assert _codes(short, "tx-bad") == ["premature_release"]
    assert [f for f in long["findings"] if f["transfer_id"] == "tx-bad"] == [
        f for f in short["findings"] if f["transfer_id"] == "tx-bad"
    ]
    assert long["summary"]["compaction"]["tombstones"] > 0  # the background sides were compacted


def test_a_second_release_minutes_after_a_clean_one_is_a_late_event_however_long_the_log(tmp_path: Path) -> None:
    p, c = Side("prefill-0/tp0", start_ts=1000.0), Side("decode-0/tp0", start_ts=1000.0)
    incident = [
        p.map("tx-twice", "p-1", blocks=(1,), ts=1000.0),
        p.ack("tx-twice", "release", ts=1000.5),
        p.ack("tx-twice", "release", rank=1, ts=4000.0),  # fifty minutes later, long after compaction
    ]
    short = _replay(tmp_path, "short", incident)
    long = _replay(tmp_path, "long", incident[:2] + _traffic(p, c, start=1001.0) + incident[2:])
    assert _codes(short, "tx-twice") == _codes(long, "tx-twice") == ["late_event"]
    (finding,) = [f for f in long["findings"] if f["transfer_id"] == "tx-twice"]
    assert finding["request_id"] == "p-1" and finding["block_ids"] == [1]
    assert long["summary"]["compaction"]["tombstones"] > 0 and long["events"] > 16_384


def test_a_reused_transfer_id_is_refused_and_reported_however_long_ago_it_was_used(tmp_path: Path) -> None:
    p, c = Side("prefill-0/tp0", start_ts=1000.0), Side("decode-0/tp0", start_ts=1000.0)
    first = [p.map("tx-again", "p-1", blocks=(1,), ts=1000.0), p.ack("tx-again", "release", ts=1000.5)]
    again = [p.map("tx-again", "p-2", blocks=(3,), ts=4000.0)]
    long = _replay(tmp_path, "long", first + _traffic(p, c, start=1001.0) + again)
    (finding,) = [f for f in long["findings"] if f["transfer_id"] == "tx-again"]
    assert finding["code"] == "id_reuse" and finding["request_id"] == "p-1" and "p-2" in finding["detail"]
    assert long["summary"]["live_transfers"] == 0  # the refused map holds nothing
