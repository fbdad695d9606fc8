"""Prometheus metrics in a registry of the app's own: counters read from the live fold at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvledger.api.live import Live
from kvledger.ledger.audit import CODES
from kvledger.ledger.picture import live_by_phase
from kvledger.ledger.sources import SourceHealth

RELEASE_LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300,
)  # fmt: skip


def fold_metrics(
    *,
    events_by_kind: Mapping[str, int],
    live_transfers: int,
    blocks_held: int,
    releases_by_cause: Mapping[str, int],
    forged_by_reason: Mapping[str, int],
    lease_counts: Mapping[str, int],
    finding_counts: Mapping[str, int],
    live_by_phase: Mapping[str, int],
    health: Mapping[str, SourceHealth],
) -> Iterator[Metric]:
    """The metrics that derive from the fold, from one fold's figures (the one-process service's, or
    partition workers' merged: `kvledger.api.fleet`)."""
    events = CounterMetricFamily("kvledger_events", "Events folded, by kind", labels=["kind"])
    for kind, count in events_by_kind.items():
        events.add_metric([kind], count)
    yield events
    yield GaugeMetricFamily("kvledger_live_transfers", "Transfer sides holding blocks", value=live_transfers)
    yield GaugeMetricFamily("kvledger_blocks_held", "KV blocks held by live transfers", value=blocks_held)
    releases = CounterMetricFamily("kvledger_releases", "Releases decided, by cause", labels=["cause"])
    for cause, count in releases_by_cause.items():
        releases.add_metric([cause], count)
    yield releases
    forged = CounterMetricFamily(
        "kvledger_forged_messages",
        "Control messages from peers dropped as unproven (bad or missing MAC, unlisted sender), by reason",
        labels=["reason"],
    )
    for reason, count in forged_by_reason.items():
        forged.add_metric([reason], count)
    yield forged
    leases = CounterMetricFamily(
        "kvledger_leases",
        "Lease renewals folded (renewals), producer sides expired after a missed lease (expiries), and reads "
        "refused because the producer no longer held the transfer (reads_refused)",
        labels=["what"],
    )
    for what in ("renewals", "expiries", "reads_refused"):
        leases.add_metric([what], lease_counts.get(what, 0))
    yield leases
    findings = GaugeMetricFamily("kvledger_findings", "Audit findings now, by code", labels=["code", "severity"])
    for code, count in finding_counts.items():
        findings.add_metric([code, CODES[code]], count)
    yield findings
    phases = GaugeMetricFamily("kvledger_live_transfers_by_phase", "Transfer sides holding blocks, by phase",
                               labels=["phase"])  # fmt: skip
    for phase, count in live_by_phase.items():
        phases.add_metric([phase], count)
    yield phases
    # What lost sources hold (kvledger.ledger.sources: silent while holding, or known dead).
    lost = [h for h in health.values() if h.lost]
    yield GaugeMetricFamily("kvledger_sources_lost", "Sources lost (silent while holding blocks, or known dead)",
                            value=len(lost))  # fmt: skip
    yield GaugeMetricFamily("kvledger_blocks_lost", "Blocks held by lost sources: gone with the engine, not leaked",
                            value=sum(h.blocks_held for h in lost))  # fmt: skip


def request_metrics(streams_open: int, uploads_running: int, replays_running: int) -> Iterator[Metric]:
    """What the service is serving now, the one-process service's and the partition workers' alike."""
    yield GaugeMetricFamily("kvledger_streams_open", "Live event streams being served", value=streams_open)
    yield GaugeMetricFamily("kvledger_replay_uploads_reading", "Uploads being read", value=uploads_running)
    yield GaugeMetricFamily("kvledger_replays_running", "Uploaded logs being replayed", value=replays_running)


class LiveCollector(Collector):
    """Reads the live fold when scraped, so nothing is counted twice or kept in a second place."""

    def __init__(self, get_live: Callable[[], Live | None]) -> None:
        self._get_live = get_live

    def collect(self) -> Iterator[Metric]:
        live = self._get_live()
        if live is None:
            return
        state = live.state
        yield from fold_metrics(
            events_by_kind=live.events_by_kind,
            live_transfers=len(state.live),
            blocks_held=state.blocks_held,
            releases_by_cause={str(k): v for k, v in state.releases_by_cause.items()},
            forged_by_reason=state.forged_by_reason,
            lease_counts=state.lease_counts,
            finding_counts=live.published().counts,
            live_by_phase=live_by_phase(state),
            health=live.health(live.clock_now()),
        )
        yield from request_metrics(live.streams_open, live.uploads_running, live.replays_running)
        yield GaugeMetricFamily("kvledger_cursor", "Store-wide cursor of the last folded event", value=live.cursor)
        yield GaugeMetricFamily(
            "kvledger_quarantined_events",
            "Events in the store's quarantine: refused for their content, never retried (GET /quarantine)",
            value=live.quarantined,
        )
        yield CounterMetricFamily(
            "kvledger_fold_errors", "Stored events the fold could not take (passed over)", value=live.fold_errors
        )
        yield GaugeMetricFamily(
            "kvledger_store_up",
            "1 when the store answered the last poll",
            value=int(live.store is not None and live.store_error is None),
        )


def build_registry(get_live: Callable[[], Live | None]) -> tuple[CollectorRegistry, Histogram]:
    """A fresh registry (no process-wide globals) and the release-latency histogram the fold feeds."""
    registry = CollectorRegistry(auto_describe=True)
    histogram = Histogram(
        "kvledger_release_latency_seconds",
        "From a transfer side's first event to its release decision",
        ["cause"],
        buckets=RELEASE_LATENCY_BUCKETS_S,
        registry=registry,
    )
    registry.register(LiveCollector(get_live))
    return registry, histogram
