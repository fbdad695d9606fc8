"""A transfer's events laid out for the web page: marks on a time axis (one lane per source) and a row in words
each. Presentation only: the words are kvledger.ledger.timeline's `describe`, and the story a fold tells (decisions and
why) is kvledger.ledger.timeline's `build`."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvledger.api.svg import time_ticks
from kvledger.ledger.events import Event, kind_of
from kvledger.ledger.humanize import duration, offset, utc
from kvledger.ledger.side import TransferState
from kvledger.ledger.timeline import describe

WIDTH_PX, LANE_PX, MARGIN_LEFT_PX, MARGIN_RIGHT_PX, TOP_PX = 960, 56, 170, 30, 36
COLORS = {"map": "#2563eb", "schedule": "#7c3aed", "seal": "#0891b2", "ack": "#16a34a",
          "fail": "#dc2626", "expire": "#ea580c", "drop": "#111827"}  # fmt: skip
CAUSE_COLORS = {"completed": "#16a34a", "failed": "#dc2626", "expired": "#ea580c"}
NOW_STRETCH_MAX = 1.5
"""`now` stretches the axis only up to this many times the events' own span; later, it is an arrow at the
right edge saying how much later (a transfer of 3 s seen 2 min later stays readable)."""


@dataclass
class Mark:
    x: float
    y: float
    color: str
    title: str


@dataclass
class Line:
    x: float
    color: str
    label: str
    dashed: bool = False


@dataclass
class TimelineView:
    width: int
    height: int
    lanes: list[tuple[str, float]] = field(default_factory=list)
    marks: list[Mark] = field(default_factory=list)
    lines: list[Line] = field(default_factory=list)
    ticks: list[tuple[float, str]] = field(default_factory=list)
    rows: list[tuple[str, str, str, str, str]] = field(default_factory=list)
    """(time, +offset, source, kind, what happened) per event, in store order."""


def lay_out(
    events: list[Event], sides: list[TransferState], now: float, lost: frozenset[str] = frozenset()
) -> TimelineView:
    """Lay out `events` over the span from the first event to the last event or deadline, and on to `now`
    while something is held (within `NOW_STRETCH_MAX`). Sides of sources in `lost` died holding their blocks."""
    sources = list(dict.fromkeys([t.source for t in sides] + [e.source for e in events]))
    view = TimelineView(width=WIDTH_PX, height=TOP_PX + LANE_PX * max(1, len(sources)) + 24)
    if not events:
        return view
    start = min(e.ts for e in events)
    ends = [e.ts for e in events] + [t.deadline for t in sides if t.deadline is not None and t.live]
    span = max(max(ends) - start, 1e-6)
    held = any(t.live for t in sides)
    if held and now - start > span:
        span = min(now - start, NOW_STRETCH_MAX * span)
    usable = WIDTH_PX - MARGIN_LEFT_PX - MARGIN_RIGHT_PX

    def x(ts: float) -> float:
        return MARGIN_LEFT_PX + usable * (min(ts, start + span) - start) / span

    lane_y = {s: TOP_PX + LANE_PX * i + LANE_PX / 2 for i, s in enumerate(sources)}
    view.lanes = list(lane_y.items())
    ticks, _ = time_ticks(0.0, span)
    view.ticks = [(x(start + t), offset(t)) for t in ticks]
    for e in events:
        kind = kind_of(e)
        what = describe(e)
        view.marks.append(Mark(x(e.ts), lane_y[e.source], COLORS[kind], f"#{e.seq} {kind}: {what}"))
        view.rows.append((utc(e.ts), offset(e.ts - start), f"{e.source} #{e.seq}", kind, what))
    for t in sides:
        if t.decision is not None:
            d = t.decision
            view.lines.append(Line(x(d.ts), CAUSE_COLORS[d.cause], f"{t.source}: released ({d.cause}) at #{d.seq}"))
        elif t.live and t.deadline is not None and t.source in lost:
            view.lines.append(
                Line(x(t.deadline), "#6b7280", f"{t.source}: deadline, held when its engine was lost", dashed=True)
            )
        elif t.live and t.deadline is not None:
            view.lines.append(Line(x(t.deadline), "#dc2626", f"{t.source}: deadline, still held", dashed=True))
    if held:
        later = f" ({duration(now - start - span)} past the right edge)" if now > start + span else ""
        view.lines.append(
            Line(x(now), "#6b7280", f"now, {offset(now - start)} after the first event{later}", dashed=True)
        )
    return view
