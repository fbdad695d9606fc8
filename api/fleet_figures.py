"""What the page, `/audit/summary` and `/metrics` read, merged from partition workers' answers (`kvledger
serve --partitions`): the same figures the one-process service reads of its fold, so the same rendering
(`kvledger.api.board.compose`, `kvledger.api.routes.audit.summary_of`, `kvledger.api.metrics.fold_metrics`)
gives the same answer.

Every figure is one fold's under the merge (`kvledger.ledger.picture.merge_pictures`,
`kvledger.ledger.partitioned.merge_counts`, `merge_latencies`), but one: the blocks-held-over-time series
(a source's blocks held after each event, its sides spread over partitions), which the page says is not
drawn instead of drawing it. Each finding's time (for the findings-over-time plot) is its partition's, or,
for a `double_owner` the merge judged, asked of the worker folding its side. The oldest side held on a
live engine is the first, in map order, of the merge's block ownership (`Ownership.sides`: every live
side's accepted map, in stream order, as `state.live` keeps them in one fold) whose source is not lost;
its state is asked of the worker folding it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from kvledger.api.board import Board, Figures, compose, findings_plot
from kvledger.api.settings import Settings
from kvledger.ledger.advice import LatencyRecorder
from kvledger.ledger.audit import Finding
from kvledger.ledger.decisions import Key
from kvledger.ledger.ownership import Ownership
from kvledger.ledger.partitioned import PartitionAnswer, merge_counts, merge_latencies
from kvledger.ledger.picture import Picture, merge_pictures
from kvledger.ledger.side import TransferState
from kvledger.ledger.sources import SourceHealth, judge, oldest_on_live_source

UNPLOTTED = (
    "Not drawn: this service merges partition workers' answers, and a source's blocks held over time is not "
    "merged across partitions yet (each partition holds part of a source's blocks; docs/fleet.md)."
)
"""What the page says in place of the blocks-held plot."""


class FleetFigures(NamedTuple):
    """One fold's figures beside its findings, merged from every owned partition's answer at one `now`."""

    picture: Picture
    counts: dict[str, Any]
    """`kvledger.ledger.summary.state_counts`, merged."""
    latency: LatencyRecorder
    health: dict[str, SourceHealth]
    oldest_key: Key | None
    """The side `Figures.oldest_live` is (its state is the worker's: `Fleet.transfer`)."""
    through: int
    """The store cursor every owned partition's answer is complete through: what the audit covers."""
    found_at: list[float | None]
    """When each merged finding became true (`kvledger.ledger.audit.found_at`), as its partition said; None for
    those the merge judged (`double_owner`): the worker folding the side is asked (`Fleet.audit`)."""


def merge_figures(
    answers: Sequence[PartitionAnswer],
    findings: Sequence[Finding],
    ownership: Ownership,
    now: float,
    settings: Settings,
    *,
    through: int,
) -> FleetFigures:
    """The figures of `answers` (each owned partition once, with its picture) at `now`, beside `findings` (their
    merge); `ownership` is the merge's block ownership (read where the merge cannot move); `through` the
    cursor the answers cover."""
    pictures = [a.picture for a in answers if a.picture is not None]
    if len(pictures) != len(answers):
        raise ValueError("a partition answered without its picture")
    picture = merge_pictures(pictures)
    told = [f for a in answers for f in a.findings]  # the pictures' `found_at` order
    if len(told) != len(picture.found_at):
        raise ValueError(f"{len(picture.found_at)} finding times for {len(told)} findings")
    found = {id(f): at for f, at in zip(told, picture.found_at, strict=True)}
    health = judge(
        picture.held, picture.last_ts, now, transfer_timeout_s=settings.transfer_timeout_s,
        dead=settings.dead_engines,
    )  # fmt: skip
    oldest = oldest_on_live_source(ownership.sides.values(), health)
    return FleetFigures(
        picture=picture,
        counts=merge_counts([a.counts for a in answers]),
        latency=merge_latencies(list(answers)),
        health=health,
        oldest_key=(oldest.source, oldest.transfer_id) if oldest is not None else None,
        through=through,
        found_at=[found.get(id(f)) for f in findings],
    )


def board_of(
    figures: FleetFigures,
    findings: list[Finding],
    found: list[float],
    oldest: TransferState | None,
    settings: Settings,
    now: float,
    *,
    explicit: bool,
    events: int,
) -> Board:
    """The page's board of merged figures (the one-process page's `compose` and `findings_plot`: each finding at
    `found`), the blocks-held plot not drawn."""
    p = figures.picture
    board_figures = Figures(
        findings=findings,
        health=figures.health,
        oldest_live=oldest,
        newest_ts=max(p.last_ts.values(), default=None),
        first_ts=p.first_map[1] if p.first_map is not None else None,
        events=sum(p.events_by_kind.values()),
        releases_by_cause=dict(figures.counts["releases_by_cause"]),
        latency=figures.latency,
        late_after_expire=p.late_after_expire,
    )
    board = compose(board_figures, settings, now, explicit=explicit, version=events, cursor=0)
    start = p.first_map[1] if p.first_map is not None else None
    board.plots["findings"] = findings_plot(findings, found, figures.health, start, p.holding_end_ts, now)
    board.unplotted = UNPLOTTED
    return board
