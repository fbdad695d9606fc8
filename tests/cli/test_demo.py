"""`kvledger demo`, the README's main job: a storm on a SQLite ledger, the comparison, then the service."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import httpx

from kvledger.connector.ports import free_loopback_ports
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


def test_demo_counts_the_storms_forgeries_and_says_the_dead_engines_sides_were_lost(tmp_path: Path) -> None:
    """The first screen: injected faults counted, not logged line by line; no finding read as its opposite."""
    storm = ["--requests", "300", "--concurrency", "32", "--seed", "1", "--no-serve"]
    figures_run = subprocess.run(
        [KVLEDGER, "demo", *storm, "--dir", str(tmp_path / "a"), "--json"], capture_output=True, text=True, timeout=600
    )
    assert figures_run.returncode == 0, figures_run.stdout + figures_run.stderr
    figures = json.loads(figures_run.stdout.strip().splitlines()[-1])
    assert figures["forged_sent"] > 0 and figures["findings_on_dead_engine"].get("leak", 0) > 0, figures
    result = subprocess.run(
        [KVLEDGER, "demo", *storm, "--dir", str(tmp_path / "b")], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "dropped: bad_mac" not in result.stdout + result.stderr
    screen = " ".join(result.stdout.split())  # the console wraps long lines at its width
    assert f"forged releases: {figures['forged_sent']} sent, 0 accepted" in screen
    dead = dict(figures["findings_on_dead_engine"])
    assert f"the {dead.pop('leak')} transfer sides it held died with it (lost, not leaked" in screen
    others = screen.split("other findings in its log before it died: ")[1].split(" offline replay")[0]
    assert "leak" not in others and others == ", ".join(f"{code} {n}" for code, n in sorted(dead.items()))


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
        assert summary["timeout_advice"].startswith("p99 completed-release latency"), summary["timeout_advice"]
    finally:
        process.terminate()
        output, _ = process.communicate(timeout=30)
    assert f"http://127.0.0.1:{port}/" in output
