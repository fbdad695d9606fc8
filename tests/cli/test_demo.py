"""`kvledger demo`, the README's main job: a storm on a SQLite ledger, the comparison, then the service."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import httpx

from connector.ports import free_loopback_ports
from tests.cli.test_replay_cli import KVLEDGER

SMALL = ["--requests", "200", "--concurrency", "32", "--seed", "3"]


def test_demo_leaves_nothing_held_where_naive_bookkeeping_strands_blocks(tmp_path: Path) -> None:
    result = subprocess.run(
        [KVLEDGER, "demo", *SMALL, "--dir", str(tmp_path / "demo"), "--no-serve", "--json"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["leaked_blocks"] == 0 and figures["hung_requests"] == 0
    assert figures["double_releases"] == 0 and figures["premature_releases"] == 0
    assert figures["naive_leaked_blocks"] > 0 or figures["naive_hung_requests"] > 0
    assert figures["replay_matches"] is True
    db, log = tmp_path / "demo" / "ledger.db", tmp_path / "demo" / "incident.jsonl"
    assert db.stat().st_size > 0 and log.stat().st_size > 0
    replay = subprocess.run(
        [KVLEDGER, "replay", str(db), "--json", "--fail-on", "never"], capture_output=True, text=True
    )
    assert replay.returncode == 0, replay.stderr
    assert json.loads(replay.stdout)["events"] == figures["events"]


def test_demo_then_serves_the_ledger_it_wrote(tmp_path: Path) -> None:
    (port,) = free_loopback_ports(1)
    process = subprocess.Popen(
        [KVLEDGER, "demo", *SMALL, "--dir", str(tmp_path / "demo"), "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        body = ""
        for _ in range(600):  # bounded: the storm, then the service's start
            assert process.poll() is None, process.stdout.read() if process.stdout else "exited"
            try:
                response = httpx.get(f"http://127.0.0.1:{port}/audit/summary", timeout=2)
                if response.status_code == 200:
                    body = response.text
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        summary = json.loads(body)
        assert httpx.get(f"http://127.0.0.1:{port}/", timeout=5).status_code == 200
        # The service and the offline replay fold the same ledger the same way.
        replay = subprocess.run(
            [KVLEDGER, "replay", str(tmp_path / "demo" / "ledger.db"), "--json", "--fail-on", "never"],
            capture_output=True, text=True,
        )  # fmt: skip
        offline = json.loads(replay.stdout)["summary"]
        # The engine the storm killed is lost, not leaking: the oldest side held is never one of its.
        assert summary["lost_sources"], summary
        assert all(why.startswith("known dead") for why in summary["lost_sources"].values())
        assert 0 < summary["blocks_lost"] <= summary["blocks_held"]
        oldest = summary["oldest_held"]
        assert oldest is None or oldest["source"] not in summary["lost_sources"]
        assert summary["blocks_held"] == offline["blocks_held"]
        assert summary["live_transfers"] == offline["live_transfers"]
        assert {k: v for k, v in summary["releases_by_cause"].items() if v} == offline["releases_by_cause"]
    finally:
        process.terminate()
        output, _ = process.communicate(timeout=30)
    assert f"http://127.0.0.1:{port}/" in output
