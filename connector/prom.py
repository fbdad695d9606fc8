"""`vllm:kvledger_*`: the ledger's figures (`connector/figures.py`) in vLLM's own Prometheus `/metrics`.

Built by `LedgerConnector.build_prom_metrics` in vLLM's front-end process, which
gets each step's stats payload (`LedgerStats.data`, or observe mode's
`{"wrapped": ..., "kvledger": ...}`, whose wrapped part goes to the wrapped
connector's own metrics unchanged). Labels are vLLM's (`model_name`, `engine`)
plus one per breakdown (`phase`, `cause`, `code`, `reason`), as NIXL's metrics are
made (one child per engine, `create_metric_per_engine`).

| metric | kind | what |
| --- | --- | --- |
| `vllm:kvledger_requests_held` | gauge | requests whose blocks are held waiting on a transfer (#58004) |
| `vllm:kvledger_blocks_held` | gauge | KV blocks held waiting on transfers |
| `vllm:kvledger_live_transfers{phase}` | gauge | live transfer sides by phase |
| `vllm:kvledger_releases_total{cause}` | counter | releases by cause: completed, failed, expired |
| `vllm:kvledger_findings{code}` | gauge | audit findings open now, by code, of the sides still held |
| `vllm:kvledger_findings_found_total{code}` | counter | findings counted when first found, by code |
| `vllm:kvledger_memory_bound_total{what}` | counter | what the memory bounds evicted and left unjudged |
| `vllm:kvledger_ack_latency_seconds` | histogram | a side's map to its completion ack |
| `vllm:kvledger_release_latency_seconds` | histogram | a side's map to its release decision |
| `vllm:kvledger_control_messages_dropped_total{reason}` | counter | control messages dropped or refused |

What the running audit covers: the ledger forgets decided sides (`Ledger.maintain`), and a forgotten side
takes its open findings with it, so `vllm:kvledger_findings` counts the sides still held.
`vllm:kvledger_findings_found_total` counts `late_event`, `duplicate`, `over_ack` and `id_reuse` at a side's
first event of that kind and `orphan_ack` when a never-mapped side expires (the connector expires it at the
transfer timeout); forgetting never lowers it, so it equals what an offline `kvledger replay` of the same
log reports for those codes (tests/sim/test_running_audit.py) as long as the memory bounds left nothing
unjudged. `vllm:kvledger_memory_bound_total` says when they did: `tombstones_evicted` and `orphans_evicted`
count what the bounds evicted; `late_after_eviction`, `reused_after_eviction` and `sides_unchecked` count
the events and sides whose decisions or findings may then differ from the whole history's
(`kvledger.ledger.summary.compaction_warning`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, PromMetric, PromMetricT
from vllm.v1.metrics.utils import create_metric_per_engine

from kvledger.connector.figures import (
    ACK_LATENCY,
    BLOCKS_HELD,
    CONTROL_DROPPED,
    FINDINGS,
    FINDINGS_FOUND,
    LIVE_BY_PHASE,
    MEMORY_BOUND,
    RELEASE_LATENCY,
    RELEASED,
    REQUESTS_HELD,
)
from kvledger.ledger.audit import CODES
from kvledger.ledger.decisions import CAUSES
from kvledger.ledger.lifecycle import Phase

if TYPE_CHECKING:
    from vllm.config import VllmConfig

LATENCY_BUCKETS_S = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 480.0)
PHASES = (Phase.UNMAPPED, Phase.HELD, Phase.ACTIVE, Phase.SEALED)
"""The phases a live side can be in (the others are decisions)."""
FOUND_CODES = ("late_event", "duplicate", "over_ack", "id_reuse", "orphan_ack")
"""The codes the ledger counts when first found (`LedgerState.found_by_code`)."""
BOUND_COUNTS = (
    "tombstones_evicted",
    "orphans_evicted",
    "late_after_eviction",
    "reused_after_eviction",
    "sides_unchecked",
)
"""What `vllm:kvledger_memory_bound_total` counts: `kvledger.ledger.summary.compaction_report`'s counts (not the
tombstones held: a level)."""


class LedgerPromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
        *,
        wrapped: KVConnectorPromMetrics | None = None,
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.wrapped = wrapped
        self._totals_seen: dict[tuple[str, int, str], int] = {}
        """(figure, engine, label) -> the cumulative total last counted (the ledger reports totals)."""
        # vLLM's metric classes (prometheus_client's, or Ray's wrappers) share these keywords.
        gauge: Any = self._gauge_cls
        counter: Any = self._counter_cls
        histogram: Any = self._histogram_cls
        self.requests_held = self._per_engine(gauge(
            name="vllm:kvledger_requests_held", labelnames=labelnames, multiprocess_mode="mostrecent",
            documentation="Requests whose KV blocks are held waiting on a transfer (kvledger)."))  # fmt: skip
        self.blocks_held = self._per_engine(gauge(
            name="vllm:kvledger_blocks_held", labelnames=labelnames, multiprocess_mode="mostrecent",
            documentation="KV blocks held waiting on transfers (kvledger)."))  # fmt: skip
        self.live = self._by(gauge(
            name="vllm:kvledger_live_transfers", labelnames=[*labelnames, "phase"], multiprocess_mode="mostrecent",
            documentation="Live transfer sides by phase (kvledger)."), PHASES)  # fmt: skip
        self.releases = self._by(counter(
            name="vllm:kvledger_releases", labelnames=[*labelnames, "cause"],
            documentation="Releases of held KV blocks by cause (kvledger)."), CAUSES)  # fmt: skip
        self.findings = self._by(gauge(
            name="vllm:kvledger_findings", labelnames=[*labelnames, "code"], multiprocess_mode="mostrecent",
            documentation="Audit findings open now, by code, of the transfer sides the ledger still holds: a "
                          "decided side it forgot takes its findings with it; vllm:kvledger_findings_found_total "
                          "keeps them (kvledger)."), tuple(CODES))  # fmt: skip
        self.findings_found = self._by(counter(
            name="vllm:kvledger_findings_found", labelnames=[*labelnames, "code"],
            documentation="Audit findings counted when first found, by code (late_event, duplicate, over_ack, "
                          "id_reuse; orphan_ack when a never-mapped side expires): never lowered when the ledger "
                          "forgets decided sides, so equal to an offline replay of the same log while "
                          "vllm:kvledger_memory_bound_total counts no event left unjudged (kvledger)."),
            FOUND_CODES)  # fmt: skip
        self.memory_bound = self._by(counter(
            name="vllm:kvledger_memory_bound", labelnames=[*labelnames, "what"],
            documentation="What the ledger's memory bounds changed: tombstones_evicted, orphans_evicted, and "
                          "events left unjudged, late_after_eviction, reused_after_eviction, sides_unchecked "
                          "(nonzero: some decisions or findings are not exact) (kvledger)."),
            BOUND_COUNTS)  # fmt: skip
        self.ack_latency = self._per_engine(histogram(
            name="vllm:kvledger_ack_latency_seconds", labelnames=labelnames, buckets=LATENCY_BUCKETS_S,
            documentation="Seconds from a transfer side's map to its completion ack (kvledger)."))  # fmt: skip
        self.release_latency = self._per_engine(histogram(
            name="vllm:kvledger_release_latency_seconds", labelnames=labelnames, buckets=LATENCY_BUCKETS_S,
            documentation="Seconds from a transfer side's map to its release decision (kvledger)."))  # fmt: skip
        self._dropped: Any = counter(
            name="vllm:kvledger_control_messages_dropped", labelnames=[*labelnames, "reason"],
            documentation="Control messages between engines dropped or refused, by reason (kvledger).")  # fmt: skip
        for labelvalues in per_engine_labelvalues.values():
            self._dropped.labels(*labelvalues, "none")  # the series exists (at 0) before the first drop

    def _per_engine(self, metric: Any) -> dict[int, Any]:
        return create_metric_per_engine(metric, self.per_engine_labelvalues)

    def _by(self, metric: Any, values: tuple[str, ...]) -> dict[tuple[int, str], Any]:
        return {
            (engine, value): metric.labels(*labelvalues, value)
            for engine, labelvalues in self.per_engine_labelvalues.items()
            for value in values
        }

    def _count_up(
        self, figure: str, counters: dict[tuple[int, str], Any], engine_idx: int, totals: Mapping[str, int] | None
    ) -> None:
        """Counters fed a figure the ledger reports as cumulative totals by label: each takes the step since the
        last report (never back: a restarted engine's totals start again below what was counted)."""
        for label, total in (totals or {}).items():
            key = (engine_idx, label)
            seen_key = (figure, engine_idx, label)
            seen = self._totals_seen.get(seen_key, 0)
            if key in counters and total > seen:
                counters[key].inc(total - seen)
            self._totals_seen[seen_key] = max(seen, total)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        figures: Mapping[str, Any] = transfer_stats_data
        if "kvledger" in transfer_stats_data or "wrapped" in transfer_stats_data:
            wrapped = transfer_stats_data.get("wrapped")
            if self.wrapped is not None and wrapped:
                self.wrapped.observe(wrapped, engine_idx)
            figures = transfer_stats_data.get("kvledger") or {}
        if REQUESTS_HELD not in figures and CONTROL_DROPPED not in figures:
            return
        if REQUESTS_HELD in figures:
            self.requests_held[engine_idx].set(figures[REQUESTS_HELD])
            self.blocks_held[engine_idx].set(figures[BLOCKS_HELD])
            phases = figures.get(LIVE_BY_PHASE) or {}
            for phase in PHASES:
                self.live[(engine_idx, phase)].set(phases.get(phase, 0))
            found = figures.get(FINDINGS) or {}
            for code in CODES:
                self.findings[(engine_idx, code)].set(found.get(code, 0))
            self._count_up(RELEASED, self.releases, engine_idx, figures.get(RELEASED))
            self._count_up(FINDINGS_FOUND, self.findings_found, engine_idx, figures.get(FINDINGS_FOUND))
            self._count_up(MEMORY_BOUND, self.memory_bound, engine_idx, figures.get(MEMORY_BOUND))
        for seconds in figures.get(ACK_LATENCY) or ():
            self.ack_latency[engine_idx].observe(seconds)
        for seconds in figures.get(RELEASE_LATENCY) or ():
            self.release_latency[engine_idx].observe(seconds)
        labelvalues = self.per_engine_labelvalues[engine_idx]
        for reason, count in (figures.get(CONTROL_DROPPED) or {}).items():
            self._dropped.labels(*labelvalues, reason).inc(count)
