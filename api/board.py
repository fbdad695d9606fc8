"""The page's picture of the ledger at one audit time: findings grouped, sources judged, plots drawn.

Built from the live fold in one pass (`build`), so the page itself only renders: with 100k findings an
audit takes a second or more, and a page that audited on every request could not answer in 200 ms.
`BoardKeeper` decides when to build: a small ledger is rebuilt before answering whenever it changed or a
second passed; a large one is rebuilt in the background, at most once per `BOARD_COST_FACTOR` times its
last build, while the page shows the last board and says how old it is.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from markupsafe import Markup
from starlette.concurrency import run_in_threadpool

from kvledger.api import plots
from kvledger.api.limits import BOARD_COST_FACTOR, BOARD_SYNC_BUILD_MAX_S
from kvledger.api.live import Live
from kvledger.api.settings import Settings
from kvledger.ledger.advice import LatencyRecorder, late_after_expire, percentiles, verdict
from kvledger.ledger.audit import CODES, SEVERITY_RANK, Finding, found_at
from kvledger.ledger.side import TransferState
from kvledger.ledger.sources import SourceHealth, oldest_on_live_source

CODE_ORDER = {code: i for i, code in enumerate(CODES)}


@dataclass(frozen=True)
class Group:
    """The findings of one code on one source: one row on the page, expandable to its transfers."""

    code: str
    severity: str
    source: str
    lost: bool
    findings: list[Finding]
    blocks: int

    @property
    def count(self) -> int:
        return len(self.findings)


@dataclass(frozen=True)
class LostEngine:
    engine: str
    why: str
    last_ts: float
    sides: int
    blocks: int
    sources: list[SourceHealth]
    counts: dict[str, int]


@dataclass
class Board:
    now: float
    explicit: bool
    """`now` was asked for (`?now=`) rather than the clock's."""
    version: int
    cursor: int
    built_at: float = 0.0
    build_s: float = 0.0
    findings_total: int = 0
    live_counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CODES, 0))
    groups: list[Group] = field(default_factory=list)
    sources: list[SourceHealth] = field(default_factory=list)
    lost: list[LostEngine] = field(default_factory=list)
    sides_live: int = 0
    blocks_live: int = 0
    oldest_live: TransferState | None = None
    newest_ts: float | None = None
    first_ts: float | None = None
    events: int = 0
    releases_by_cause: dict[str, int] = field(default_factory=dict)
    completed_s: dict[str, float | None] = field(default_factory=dict)
    advice: str = ""
    defer_timeout_s: float = 0.0
    transfer_timeout_s: float = 0.0
    plots: dict[str, Markup] = field(default_factory=dict)
    unplotted: str = "The blocks-held plot is not drawn for this board."
    """Why the blocks-held-over-time plot is not drawn; empty where it is."""

    def group(self, code: str, source: str) -> Group | None:
        return next((g for g in self.groups if g.code == code and g.source == source), None)

    @property
    def live_groups(self) -> list[Group]:
        return [g for g in self.groups if not g.lost]

    @property
    def lost_groups(self) -> list[Group]:
        return [g for g in self.groups if g.lost]


@dataclass(frozen=True)
class Figures:
    """What a board is drawn from, as plain data: the one-process service's fold (`build`), or the merge of
    partition workers' answers (`kvledger.api.fleet`)."""

    findings: list[Finding]
    health: dict[str, SourceHealth]
    oldest_live: TransferState | None
    """The first side held on a live source, in map order (`kvledger.ledger.sources.oldest_on_live_source`)."""
    newest_ts: float | None
    first_ts: float | None
    """Where the blocks-held series starts: the first map's ts."""
    events: int
    releases_by_cause: dict[str, int]
    latency: LatencyRecorder
    late_after_expire: int


def build(live: Live, now: float, *, explicit: bool = False) -> Board:
    """Everything the page shows at `now`. Reads the fold: call it where the fold cannot move (fold_lock)."""
    started = time.perf_counter()
    state = live.state
    health = live.health(now)
    findings = live.findings(now)
    figures = Figures(
        findings=findings,
        health=health,
        oldest_live=oldest_on_live_source(state.live.values(), health),
        newest_ts=max(live.last_ts.values(), default=None),
        first_ts=live.holding.start_ts,
        events=sum(live.events_by_kind.values()),
        releases_by_cause={str(k): v for k, v in state.releases_by_cause.items()},
        latency=live.latency,
        late_after_expire=late_after_expire(state, findings),
    )
    board = compose(figures, live.settings, now, explicit=explicit, version=live.version, cursor=live.cursor)
    _plots_over_time(board, live, findings, health)
    board.build_s = time.perf_counter() - started
    return board


def compose(figures: Figures, settings: Settings, now: float, *, explicit: bool, version: int, cursor: int) -> Board:
    """The board of `figures` at `now`, but for the plots over time (which read the fold: `build` draws them;
    where nothing draws them, `Board.unplotted` says why)."""
    started = time.perf_counter()
    board = Board(now=now, explicit=explicit, version=version, cursor=cursor)
    health, findings = figures.health, figures.findings
    board.sources = sorted(health.values(), key=lambda h: (not h.lost, h.source))
    board.findings_total = len(findings)
    _group(board, findings, health)
    _lost_engines(board, health)
    for h in health.values():
        if not h.lost:
            board.sides_live += h.sides_held
            board.blocks_live += h.blocks_held
    board.oldest_live = figures.oldest_live
    board.newest_ts = figures.newest_ts
    board.first_ts = figures.first_ts
    board.events = figures.events
    board.releases_by_cause = figures.releases_by_cause
    board.completed_s = percentiles(figures.latency.completed)
    board.defer_timeout_s, board.transfer_timeout_s = settings.defer_timeout_s, settings.transfer_timeout_s
    board.advice = verdict(board.completed_s["p99"], settings.defer_timeout_s, figures.late_after_expire)
    board.plots["latency"] = plots.latency_plot(
        figures.latency.completed.buckets(),
        figures.latency.all_causes.buckets(),
        defer_timeout_s=board.defer_timeout_s,
        transfer_timeout_s=board.transfer_timeout_s,
        p99_s=board.completed_s["p99"],
    )
    board.built_at = time.time()
    board.build_s = time.perf_counter() - started
    return board


def _group(board: Board, findings: list[Finding], health: dict[str, SourceHealth]) -> None:
    groups: dict[tuple[str, str], list[Finding]] = {}
    for f in findings:
        groups.setdefault((f.code, f.source), []).append(f)
    made = []
    for (code, source), members in groups.items():
        lost = source in health and health[source].lost
        if not lost:
            board.live_counts[code] += len(members)
        blocks = sum(len(f.block_ids) for f in members)
        made.append(Group(code, CODES[code], source, lost, members, blocks))
    # Worst first: live before lost, then severity, then the larger group, then a stable order.
    made.sort(key=lambda g: (g.lost, SEVERITY_RANK[g.severity], -g.count, CODE_ORDER[g.code], g.source))
    board.groups = made


def _lost_engines(board: Board, health: dict[str, SourceHealth]) -> None:
    engines: dict[str, list[SourceHealth]] = {}
    for h in board.sources:
        if h.lost:
            engines.setdefault(h.engine, []).append(h)
    for engine, sources in engines.items():
        names = {h.source for h in sources}
        counts = dict.fromkeys(CODES, 0)
        for g in board.lost_groups:
            if g.source in names:
                counts[g.code] += g.count
        board.lost.append(
            LostEngine(
                engine=engine,
                why=sources[0].why,
                last_ts=max(h.last_ts for h in sources),
                sides=sum(h.sides_held for h in sources),
                blocks=sum(h.blocks_held for h in sources),
                sources=sources,
                counts={k: v for k, v in counts.items() if v},
            )
        )


def _plots_over_time(board: Board, live: Live, findings: list[Finding], health: dict[str, SourceHealth]) -> None:
    state, config = live.state, live.audit_config
    found = [found_at(f, state, config) for f in findings]
    leak_deadlines: dict[str, list[float]] = {}
    for f, at in zip(findings, found, strict=True):
        if f.code == "leak":
            leak_deadlines.setdefault(f.source, []).append(at)  # the plot greys those of lost sources
    series = live.holding
    board.plots["held"] = plots.held_plot(series, health, leak_deadlines, board.now)
    board.plots["findings"] = findings_plot(findings, found, health, series.start_ts, series.end_ts, board.now)
    board.unplotted = ""


def findings_plot(
    findings: list[Finding],
    found: list[float],
    health: dict[str, SourceHealth],
    start_ts: float | None,
    end_ts: float | None,
    now: float,
) -> Markup:
    """The findings-over-time plot: each finding at `found` (`kvledger.ledger.audit.found_at`), those on lost
    sources apart, from the blocks-held series' start (`start_ts`, the first map) to the last finding or the
    series' end (the last map or release), never past the audit time."""
    times: dict[str, list[float]] = {}
    lost_times: list[float] = []
    for f, at in zip(findings, found, strict=True):
        if f.source in health and health[f.source].lost:
            lost_times.append(at)
        else:
            times.setdefault(f.code, []).append(at)
    everything = [t for ts in times.values() for t in ts] + lost_times
    lo = start_ts if start_ts is not None else min(everything, default=now)
    hi = max(end_ts or lo, min(max(everything, default=lo), now))
    return plots.findings_plot(times, lost_times, lo, hi)


class BoardKeeper:
    """The current board, rebuilt when the ledger changed or time moved on, never more often than it costs."""

    def __init__(self, live: Live) -> None:
        self.live = live
        self.board: Board | None = None
        self._asked: Board | None = None
        """The last board built for an explicit `?now=` (tests and time travel ask the same one repeatedly)."""
        self._rebuilding: asyncio.Task[Board] | None = None

    def _stale(self, board: Board) -> bool:
        age_s = time.time() - board.built_at
        if age_s < BOARD_COST_FACTOR * board.build_s:
            return False
        return board.version != self.live.version or age_s >= self.live.settings.audit_cache_resolution_s

    async def current(self) -> Board:
        board = self.board
        if board is not None and not self._stale(board):
            return board
        if board is None or board.build_s <= BOARD_SYNC_BUILD_MAX_S:
            return await self.rebuild()
        if self._rebuilding is None or self._rebuilding.done():
            self._rebuilding = asyncio.create_task(self.rebuild(), name="kvledger-board")
        return board

    async def at(self, now: float) -> Board:
        """The board at an asked-for time, built now (or the last one, if it is for the same time and fold)."""
        asked = self._asked
        if asked is not None and asked.now == now and asked.version == self.live.version:
            return asked
        async with self.live.fold_lock:
            asked = await run_in_threadpool(build, self.live, now, explicit=True)
        self._asked = asked
        return asked

    async def close(self) -> None:
        """Wait out a background rebuild (it holds the fold lock and a thread) before the store closes."""
        task = self._rebuilding
        if task is not None and not task.done():
            await asyncio.wait([task])

    async def rebuild(self) -> Board:
        async with self.live.fold_lock:
            board = self.board
            if board is not None and not self._stale(board):
                return board  # another request rebuilt it while this one waited for the lock
            board = await run_in_threadpool(build, self.live, self.live.clock_now())
        self.board = board
        return board
