"""`kvledger db upgrade` makes a NATS stream with the written-down settings, `kvledger export` reads it into
JSONL (the offline replay's input) and loads one back: the same events, none twice."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvledger.cli.app import app
from kvledger.ledger.jsonl import read_events
from kvledger.ledger.store.connect import open_store
from kvledger.ledger.store.nats_store import NatsStore
from kvledger.ledger.synth import SynthConfig, generate

pytestmark = pytest.mark.nats


def test_db_upgrade_makes_the_stream_and_export_round_trips_it(nats_url: str, tmp_path: Path) -> None:
    runner = CliRunner()
    made = runner.invoke(app, ["db", "upgrade", "--db", nats_url])
    assert made.exit_code == 0, made.output
    store = open_store(nats_url)
    assert isinstance(store, NatsStore)
    config = store._call(store.js.stream_info(store.target.stream)).config
    assert "file" in str(config.storage) and "new" in str(config.discard) and "limits" in str(config.retention)
    assert config.duplicate_window == pytest.approx(600.0) and store.partitions == 4
    events = list(generate(SynthConfig(transfers=40, fault_rate=0.1), seed=9))
    assert store.append(events) == len(events)
    assert store.missing_messages() == 0
    store.close()
    out = tmp_path / "fleet.jsonl"
    exported = runner.invoke(app, ["export", nats_url, str(out)])
    assert exported.exit_code == 0, exported.output
    back = list(read_events(out))
    assert sorted((e.source, e.seq) for e in back) == sorted((e.source, e.seq) for e in events)
    again = runner.invoke(app, ["export", str(out), nats_url])  # loading it back stores nothing twice
    assert again.exit_code == 0, again.output
    check = open_store(nats_url)
    assert check.count() == len(events)
    check.close()


def test_a_url_asking_for_another_partition_count_is_refused(nats_url: str) -> None:
    open_store(nats_url, create=True).close()
    with pytest.raises(Exception, match="partitions"):
        open_store(nats_url.replace("partitions=4", "partitions=8"))
