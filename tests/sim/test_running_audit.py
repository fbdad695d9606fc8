"""The running connector's audit keeps its evidence: after its ledgers forgot decided sides (`Ledger.maintain`),
`vllm:kvledger_findings_found_total` still counts every finding an offline replay of the same incident log
reports, where the audit of what the ledgers still hold (`vllm:kvledger_findings`) has lost some."""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

import pytest

from kvledger.connector.figures import FINDINGS, FINDINGS_FOUND, MEMORY_BOUND, LedgerFigures
from kvledger.connector.sim.check import evaluate
from kvledger.connector.sim.config import StormConfig
from kvledger.connector.sim.driver import Storm
from kvledger.ledger.audit import audit, counts_by_code
from kvledger.ledger.jsonl import read_chunks
from kvledger.ledger.replay import replay_chunks
from tests.connector.prom_registry import registry_metrics, sample

CONFIG = StormConfig(
    seed=1010, requests=1500, concurrency=96, fault_rate=0.05, mode="read",
    faults=frozenset({"sq_full", "transfer_fail", "drop", "duplicate", "reorder", "late", "early", "never_ready"}),
)  # fmt: skip
"""Long enough that every ledger forgets decided sides many times over, with late events after that; the
faults that leave evidence on transfers (no engine dies or restarts: each source's ledger is one process's)."""


@pytest.mark.parametrize("seed", [1010, 353])
def test_the_running_audit_counts_what_an_offline_replay_of_its_log_reports_after_compaction(
    tmp_path: Path, seed: int
) -> None:
    path = tmp_path / "incident.jsonl"
    storm = Storm(dataclasses.replace(CONFIG, seed=seed, incident_log=path))
    evaluate(storm, storm.run())  # writes the incident log
    offline = replay_chunks(read_chunks(path))
    assert offline.last_ts is not None
    end = offline.last_ts
    reported = counts_by_code(audit(offline.state, end))
    ledgers = [ledger for engine in storm.engines for ledger in engine.ledgers]
    registry, prom = registry_metrics(len(ledgers))
    found: Counter[str] = Counter()
    still_open: Counter[str] = Counter()
    forgotten = 0
    for engine_idx, ledger in enumerate(ledgers):
        figures = LedgerFigures(ledger).take(end)
        assert not any(figures[MEMORY_BOUND].values()), figures[MEMORY_BOUND]  # nothing left unjudged
        prom.observe(figures, engine_idx)
        prom.observe(figures, engine_idx)  # the same totals again: counted once
        found.update(figures[FINDINGS_FOUND])
        still_open.update(figures[FINDINGS])
        forgotten += sum(ledger.state.compacted_by_phase.values())
    assert forgotten > 0
    name = "vllm:kvledger_findings_found_total"
    counted = {code: sum(sample(registry, name, i, code=code) for i in range(len(ledgers))) for code in found}
    expected = {code: n for code in ("late_event", "duplicate", "over_ack", "id_reuse") if (n := reported[code])}
    if offline.state.orphans_expired:  # the audit's other orphans are overdue, not expired yet at the log's end
        expected["orphan_ack"] = len(offline.state.orphans_expired)
    assert expected, "the storm's faults leave findings to compare"
    assert dict(found) == expected
    assert dict(counted) == expected
    assert any(still_open[code] < n for code, n in expected.items())  # what the gauge alone would have lost
