"""`vllm:kvledger_*` fed by a real ledger's figures (`LedgerFigures`): the counters that keep what the ledger
forgets (`findings_found_total`) and say what its memory bounds changed (`memory_bound_total`) count each
cumulative total once, and a ledger past its orphan bound shows it."""

from __future__ import annotations

from kvledger.connector.figures import FINDINGS, FINDINGS_FOUND, MEMORY_BOUND, LedgerFigures
from kvledger.ledger.fold import LedgerState
from kvledger.ledger.ids import stamped_id
from kvledger.ledger.ledger import Ledger
from kvledger.ledger.limits import ARRIVAL_LAG_S, ID_WINDOW_S
from kvledger.ledger.summary import compaction_report
from tests.connector.prom_registry import registry_metrics, sample
from tests.ledger.builders import Side

FOUND = "vllm:kvledger_findings_found_total"
BOUND = "vllm:kvledger_memory_bound_total"


def test_the_counters_name_every_count_the_ledger_keeps() -> None:
    from kvledger.connector.prom import BOUND_COUNTS, FOUND_CODES

    state = LedgerState()
    assert set(BOUND_COUNTS) == set(compaction_report(state)) - {"tombstones", "unstamped_held"}
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


def test_a_ledger_counts_events_behind_its_horizon_and_the_unstamped_ids_it_holds() -> None:
    p = Side("prefill-0/tp0", start_ts=5000.0)
    ledger = Ledger(p.source)
    figures = LedgerFigures(ledger)
    registry, prom = registry_metrics(1)
    stamped = stamped_id(5000.0, 1)
    for tid in (stamped, "tx-unstamped"):
        ledger.append(p.map(tid, f"p-{tid}", blocks=(len(tid),)))
        ledger.append(p.ack(tid, "release"))
    ledger.state.forget_decided(p.ts + 1)
    prom.observe(figures.take(p.ts), 0)
    assert sample(registry, BOUND, what="behind_horizon") == 0
    assert sample(registry, "vllm:kvledger_unstamped_ids_held") == 1
    ledger.state.forget_decided(5000.0 + ID_WINDOW_S + ARRIVAL_LAG_S + 1)  # retires the stamped id
    ledger.append(p.ack(stamped, "release", rank=1, ts=5000.0 + ID_WINDOW_S - 1))  # inside its window, late
    taken = figures.take(p.ts)
    assert taken[MEMORY_BOUND] == {"behind_horizon": 1}
    prom.observe(taken, 0)
    prom.observe(taken, 0)
    assert sample(registry, BOUND, what="behind_horizon") == 1  # counted once
    assert sample(registry, "vllm:kvledger_unstamped_ids_held") == 1
