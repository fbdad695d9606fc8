"""The storm's incident log replays offline to the live decisions; with a ledger_url every event reaches the store."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from typer.testing import CliRunner

from kvledger.cli.app import app
from kvledger.connector.sim.check import evaluate
from kvledger.connector.sim.config import StormConfig
from kvledger.connector.sim.driver import Storm
from kvledger.ledger.decisions import Release
from kvledger.ledger.jsonl import read_chunks
from kvledger.ledger.replay import replay_chunks
from kvledger.ledger.store.connect import open_store

CONFIG = StormConfig(seed=9, requests=400, concurrency=96, fault_rate=0.05)


def test_incident_log_replays_to_the_live_decisions(tmp_path: Path) -> None:
    for mode in ("read", "write"):
        path = tmp_path / f"{mode}.jsonl"
        storm = Storm(dataclasses.replace(CONFIG, mode=mode, incident_log=path))
        result = evaluate(storm, storm.run())
        assert result.ok and result.replay_matches, result.problems
        live: dict[str, list[Release]] = {s: r for e in storm.engines for s, r in e.releases.items()}
        assert sum(len(v) for v in live.values()) > CONFIG.requests  # both sides, both processes decided
        # kvledger.ledger.replay, the CLI's engine (it compacts as it goes): the same releases per source, in order.
        offline: dict[str, list[Release]] = {s: [] for s in live}
        for release in replay_chunks(read_chunks(path)).releases:
            offline[release.source].append(release)
        assert offline == live
        cli = CliRunner().invoke(app, ["replay", str(path), "--json"])
        assert cli.exit_code in (0, 1), cli.output  # 1: the findings the faults caused
        assert '"events": ' + str(result.events) in cli.output.replace("\n", "")


def test_ledger_url_persists_every_event_of_every_source(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/ledger.db"
    storm = Storm(dataclasses.replace(CONFIG, mode="write", ledger_url=url))
    result = evaluate(storm, storm.run())
    assert result.ok, result.problems
    store = open_store(url)
    try:
        for engine in storm.engines:
            for source, events in engine.events.items():
                assert list(store.read(source=source)) == events, source
    finally:
        store.close()
