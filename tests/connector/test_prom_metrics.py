"""`vllm:kvledger_*` fed by a real ledger's figures (`LedgerFigures`): the counters that keep what the ledger
forgets (`findings_found_total`) and say what its memory bounds changed (`memory_bound_total`) count each
cumulative total once, and a ledger past its orphan bound shows it."""

from __future__ import annotations

from kvledger.connector.figures import FINDINGS, FINDINGS_FOUND, MEMORY_BOUND, LedgerFigures
from kvledger.ledger.fold import LedgerState
from kvledger.ledger.ledger import Ledger
from kvledger.ledger.summary import compaction_report
from tests.connector.prom_registry import registry_metrics, sample
from tests.ledger.builders import Side

FOUND = "vllm:kvledger_findings_found_total"
BOUND = "vllm:kvledger_memory_bound_total"


def test_the_counters_name_every_count_the_ledger_keeps() -> None:
    from kvledger.connector.prom import BOUND_COUNTS, FOUND_CODES

    state = LedgerState()
    assert set(BOUND_COUNTS) == set(compaction_report(state)) - {"tombstones"}
    p = Side("prefill-0/tp0")
    for event in (
        p.map("a", "r-1"), p.map("a", "r-1"), p.map("a", "r-2"), p.ack("a", "release"), p.ack("a", "release"),
        p.ack("o", "release"), p.expire("o", "transfer"),
    ):  # fmt: skip
        state.apply(event)
    assert set(state.found_by_code) <= set(FOUND_CODES)
    assert state.found_by_code == {"duplicate": 1, "id_reuse": 1, "late_event": 1, "orphan_ack": 1}


def test_findings_found_outlive_the_ledger_forgetting_them_and_are_counted_once() -> None:
    p = Side("prefill-0/tp0")
    ledger = Ledger(p.source)
    figures = LedgerFigures(ledger)
    registry, prom = registry_metrics(1)
    for event in (p.map("a", "r-1", blocks=(1,)), p.ack("a", "release"), p.ack("a", "release")):
        ledger.append(event)
    prom.observe(figures.take(p.ts), 0)
    assert sample(registry, FOUND, code="late_event") == 1
    assert sample(registry, "vllm:kvledger_findings", code="late_event") == 1
    assert ledger.state.forget_decided(p.ts + 1) == 1
    taken = figures.take(p.ts + 100)  # a later audit: the forgotten side's finding is no longer open
    assert taken[FINDINGS] == {} and taken[FINDINGS_FOUND] == {"late_event": 1}
    prom.observe(taken, 0)
    prom.observe(taken, 0)
    assert sample(registry, "vllm:kvledger_findings", code="late_event") == 0
    assert sample(registry, FOUND, code="late_event") == 1  # kept, and counted once


def test_a_ledger_past_its_orphan_bound_counts_the_sides_it_could_not_check() -> None:
    p = Side("prefill-0/tp0")
    ledger = Ledger(p.source)
    ledger.state.orphan_tombstones_max = 4
    figures = LedgerFigures(ledger)
    registry, prom = registry_metrics(1)
    for i in range(6):
        ledger.append(p.ack(f"orphan-{i}", "release"))
        ledger.append(p.expire(f"orphan-{i}", "transfer"))
    ledger.state.forget_decided(p.ts + 1)
    prom.observe(figures.take(p.ts), 0)
    assert sample(registry, BOUND, what="orphans_evicted") == 4
    assert sample(registry, BOUND, what="sides_unchecked") == 0
    ledger.append(p.map("orphan-0", "p-late", blocks=(9,)))  # an evicted orphan's map: held as a new transfer
    ledger.append(p.map("fresh", "p-1", blocks=(5,)))
    taken = figures.take(p.ts)
    assert taken[MEMORY_BOUND]["sides_unchecked"] == 2
    prom.observe(taken, 0)
    prom.observe(taken, 0)
    assert sample(registry, BOUND, what="sides_unchecked") == 2
    assert sample(registry, BOUND, what="orphans_evicted") == 4
    assert sample(registry, BOUND, what="tombstones_evicted") == 0
    assert sample(registry, FOUND, code="orphan_ack") == 6
