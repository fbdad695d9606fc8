"""The page, `/audit/summary` and `/metrics` of the service over partition workers (`kvledger serve
--partitions`), rendered by the one-process service's own code from the merged figures
(`kvledger.api.fleet_figures`): what `kvledger.api.routes.web` reads of `app.state` (a board keeper, the
trust checks, a transfer's sides and events) and the metrics collector.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.concurrency import run_in_threadpool

from kvledger.api.board import Board
from kvledger.api.fleet import Fleet, FleetAudited
from kvledger.api.fleet_figures import board_of
from kvledger.api.limits import STORE_PROBE_TIMEOUT_S
from kvledger.api.metrics import fold_metrics, request_metrics
from kvledger.api.routes.audit import summary_of
from kvledger.api.schemas import AuditSummary
from kvledger.api.trust import Problem, ingest_problems
from kvledger.ledger.events import Event
from kvledger.ledger.fleet import is_stream, through_cursor
from kvledger.ledger.humanize import ago, duration
from kvledger.ledger.side import TransferState
from kvledger.ledger.store.base import StoreError


def _board(fleet: Fleet, audited: FleetAudited, *, explicit: bool) -> Board:
    f = audited.figures
    return board_of(
        f, audited.findings, audited.found_at, audited.oldest, fleet.settings, audited.now, explicit=explicit,
        events=audited.events,
    )  # fmt: skip


class FleetBoards:
    """The page's board (`kvledger.api.board.BoardKeeper`'s interface): the published merged audit's, made once
    per publication; or one at an asked-for time."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self._made: tuple[FleetAudited, Board] | None = None

    async def current(self) -> Board:
        audited = self.fleet.audited
        assert audited is not None  # published before the app serves
        made = self._made
        if made is None or made[0] is not audited:
            made = self._made = (audited, await run_in_threadpool(_board, self.fleet, audited, explicit=False))
        return made[1]

    async def at(self, now: float) -> Board:
        audited = await self.fleet.audit(now)
        return await run_in_threadpool(_board, self.fleet, audited, explicit=True)

    async def close(self) -> None:
        return None


class FleetTrust:
    """What stops the page vouching (`kvledger.api.trust.TrustChecks`'s interface, the same problems): a worker
    being started again; a store that does not answer its probe; workers behind the store: an event it holds
    past what the published audit covers (`FleetFigures.through`) was already there, not covered, more than
    `behind_after_s` ago (first seen by a probe of this page: the probe runs when the page is asked); an ingest
    failing. Never waits on a worker; at most one store probe in flight."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self._unread_since: tuple[int, float] | None = None
        """(cursor, when first seen) of an event the published audit did not cover, at a probe."""
        self._probe: asyncio.Future[int | None] | None = None
        self._probe_started = 0.0

    async def problems(self) -> list[Problem]:
        now = time.time()
        return await self._coverage(now) + ingest_problems(self.fleet.ingest_failure, now)

    async def _coverage(self, now: float) -> list[Problem]:
        """Whether the published audit covers what the store holds (a worker starting, the store, behind)."""
        fleet = self.fleet
        restarting = [w.partitions for w in fleet.workers if not w.ready.is_set()]
        if restarting:
            return [
                Problem(
                    "behind",
                    f"The worker of partitions {', '.join(map(str, restarting))} is starting again: the audit "
                    "below is what the workers answered before, not what the store holds now.",
                )
            ]
        audited = fleet.audited
        assert audited is not None  # published before the app serves
        through = audited.figures.through
        folded = "the audit below covers only what the workers had folded when it was made"
        try:
            answered, first = await self._first_unread(through, now)
        except StoreError as error:
            return [Problem("store", f"The store cannot be read ({type(error).__name__}: {error}): {folded}.")]
        if not answered:
            return [
                Problem(
                    "store",
                    f"The store did not answer within {duration(STORE_PROBE_TIMEOUT_S)} "
                    f"(asked {ago(self._probe_started, now)}): {folded}.",
                )
            ]
        if first is None:
            self._unread_since = None
            return []
        since = self._unread_since
        if since is None or through >= since[0]:  # what was unread then is covered now: behind since now at most
            since = self._unread_since = (first, now)
        if now - since[1] > fleet.settings.behind_after_s:
            return [
                Problem(
                    "behind",
                    f"The workers are behind the store: it has held events they had not folded for "
                    f"{duration(now - since[1])}: {folded}.",
                )
            ]
        return []

    async def _first_unread(self, through: int, now: float) -> tuple[bool, int | None]:
        """(whether the store answered in time, a cursor past `through` it holds an event at or below: None,
        none). A NATS stream's newest message (one stream-info request: a tail would make a consumer), a SQL
        store's first event past `through`."""
        store = self.fleet.store
        if self._probe is None or self._probe.done():

            def probe() -> int | None:
                if is_stream(store):
                    newest = through_cursor(store.last_sequence())
                    return newest if newest > through else None
                rows = store.tail(through, 1)
                return int(rows[0][0]) if rows else None

            self._probe_started = now
            self._probe = asyncio.ensure_future(run_in_threadpool(probe))
        try:
            return True, await asyncio.wait_for(asyncio.shield(self._probe), STORE_PROBE_TIMEOUT_S)
        except TimeoutError:
            return False, None


class FleetTransfers:
    """One transfer id's sides (from the worker folding its partition) and events (from the stream), for the
    page's transfer view (`kvledger.api.transfer_events.Transfers`)."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    async def sides(self, transfer_id: str) -> list[TransferState]:
        return await self.fleet.transfer(transfer_id)

    async def events(self, transfer_id: str, events_max: int) -> list[Event]:
        return await self.fleet.timeline(transfer_id, events_max)


def summary(fleet: Fleet, audited: FleetAudited) -> AuditSummary:
    """`/audit/summary` of a merged audit (the one-process service's `summary_of`)."""
    f = audited.figures
    return summary_of(
        audited.now, audited.findings, f.health, live_transfers=f.counts["live_transfers"],
        blocks_held=f.counts["blocks_held"], oldest=audited.oldest,
        releases_by_cause=dict(f.counts["releases_by_cause"]), latency=f.latency,
        late_after_expire=f.picture.late_after_expire, defer_timeout_s=fleet.settings.defer_timeout_s,
    )  # fmt: skip


class FleetCollector(Collector):
    """The metrics that derive from the fold (`kvledger.api.metrics.fold_metrics`), read of the published merged
    audit when scraped, what the service is serving (`request_metrics`), and the workers' restarts."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def collect(self) -> Iterator[Metric]:
        audited = self.fleet.audited
        if audited is None:
            return
        f = audited.figures
        p = f.picture
        yield from fold_metrics(
            events_by_kind=p.events_by_kind, live_transfers=f.counts["live_transfers"],
            blocks_held=f.counts["blocks_held"], releases_by_cause=f.counts["releases_by_cause"],
            forged_by_reason=p.forged_by_reason, lease_counts=p.lease_counts, finding_counts=audited.counts,
            live_by_phase=p.live_by_phase, health=f.health,
        )  # fmt: skip
        yield from request_metrics(self.fleet.streams_open, self.fleet.uploads_running, self.fleet.replays_running)
        yield GaugeMetricFamily(
            "kvledger_fleet_worker_restarts", "Partition worker processes started again after they exited",
            value=self.fleet.restarts,
        )  # fmt: skip


def fleet_registry(fleet: Fleet) -> CollectorRegistry:
    """A fresh registry (no process-wide globals) reading `fleet`."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(FleetCollector(fleet))
    return registry
