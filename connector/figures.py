"""The ledger's figures for vLLM's stats and `/metrics`, read from one ledger (both modes, vLLM-free).

What #58004 asks for and what an SRE pages on: requests and blocks held waiting
on transfers, live transfers by phase, releases by cause (cumulative), findings
by code (the audit at `now`: what is open in the ledger's memory), findings by
code counted when first found (cumulative: what a decided side showed stays
counted after the ledger forgot the side), what the memory bounds changed
(cumulative), and the ack and release latencies of the events
appended since the last call (read back from the log: a side's map to its
completion ack, and to its decision). Control messages dropped come from the
process that drops them (a worker's channel) as counts since the last report.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

from kvledger.connector.limits import FIGURES_AUDIT_INTERVAL_S, FIGURES_LATENCY_SAMPLES_MAX
from kvledger.ledger.audit import audit, counts_by_code
from kvledger.ledger.events import Ack
from kvledger.ledger.ledger import Ledger
from kvledger.ledger.summary import compaction_report

REQUESTS_HELD = "requests_held"
BLOCKS_HELD = "blocks_held"
LIVE_BY_PHASE = "live_by_phase"
RELEASED = "released"
FINDINGS = "findings"
FINDINGS_FOUND = "findings_found"
"""Findings by code counted when first found (`LedgerState.found_by_code`): cumulative, never lowered by the
ledger forgetting decided sides."""
MEMORY_BOUND = "memory_bound"
"""What the ledger's memory bounds evicted and the events they left unjudged (`compaction_report` less the
tombstones held): cumulative; a nonzero `late_after_eviction`, `reused_after_eviction` or `sides_unchecked`
means some decisions or findings are not exact (`kvledger.ledger.summary.compaction_warning` says which)."""
ACK_LATENCY = "ack_latency_s"
RELEASE_LATENCY = "release_latency_s"
CONTROL_DROPPED = "control_dropped"
"""Control messages dropped since the last report, by reason (a worker's channel: malformed, unexpected,
inbox full, send queue full; and whatever else its counters call dropped or refused)."""


class LedgerFigures:
    """Reads one ledger's figures; remembers which events it has already turned into latency samples."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self._findings: dict[str, int] = {}
        self._next_audit = float("-inf")
        self._seen_seq = ledger.log.next_seq - 1

    def take(self, now: float) -> dict[str, Any]:
        state = self.ledger.state
        latencies: dict[str, list[float]] = {ACK_LATENCY: [], RELEASE_LATENCY: []}
        for event in self.ledger.log.since(self._seen_seq):
            self._seen_seq = event.seq
            side = state.side((event.source, event.transfer_id))
            if side is None or side.map_event is None:
                continue
            if isinstance(event, Ack) and event.what in ("recv", "release"):
                _sample(latencies[ACK_LATENCY], event.ts - side.first_ts)
            if side.decision is not None and side.decision.seq == event.seq:
                _sample(latencies[RELEASE_LATENCY], event.ts - side.first_ts)
        phases = Counter(t.phase for t in state.live.values())
        return {
            REQUESTS_HELD: len(state.live),
            BLOCKS_HELD: state.blocks_held,
            LIVE_BY_PHASE: dict(phases),
            RELEASED: dict(state.releases_by_cause),
            FINDINGS: self._audited(now),
            FINDINGS_FOUND: dict(state.found_by_code),
            MEMORY_BOUND: {what: n for what, n in compaction_report(state).items() if what != "tombstones"},
            **latencies,
        }

    def _audited(self, now: float) -> dict[str, int]:
        """Findings by code, audited at most every `FIGURES_AUDIT_INTERVAL_S` (vLLM asks every step)."""
        if now >= self._next_audit:
            self._next_audit = now + FIGURES_AUDIT_INTERVAL_S
            self._findings = {code: n for code, n in counts_by_code(audit(self.ledger.state, now)).items() if n}
        return self._findings


def _sample(samples: list[float], seconds: float) -> None:
    if len(samples) < FIGURES_LATENCY_SAMPLES_MAX:
        samples.append(max(0.0, seconds))


def dropped_since(counters: Mapping[str, int], reported: Counter[str]) -> dict[str, int]:
    """Counts of dropped or refused control messages since the last call (`reported` is updated)."""
    out: dict[str, int] = {}
    for name, value in counters.items():
        if ("dropped" in name or "refused" in name) and value > reported[name]:
            out[name] = value - reported[name]
            reported[name] = value
    return out


def merge_figures(older: Mapping[str, Any], newer: Mapping[str, Any]) -> dict[str, Any]:
    """Two reports as one (several workers' in a step, or an interval's for vLLM's log): dropped counts and
    latency samples add up; every other figure is a snapshot, and the newer one wins."""
    out = {**older, **newer}
    dropped = Counter(older.get(CONTROL_DROPPED) or {})
    dropped.update(newer.get(CONTROL_DROPPED) or {})
    if dropped:
        out[CONTROL_DROPPED] = dict(dropped)
    for name in (ACK_LATENCY, RELEASE_LATENCY):
        samples = [*(older.get(name) or ()), *(newer.get(name) or ())]
        if samples:
            out[name] = samples[:FIGURES_LATENCY_SAMPLES_MAX]
    return out
