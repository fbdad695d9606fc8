"""The page's three plots as inline SVG: blocks held per source over time (leaks and lost engines marked),
the release-latency histogram against the timeouts, and findings over time by code.

Each function takes plain data (the board gathers it from the live fold) and returns the SVG; every mark
has a class and a title, so a person hovering and a test reading the DOM see the same facts.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence

from markupsafe import Markup

from kvledger.api.limits import PLOT_BARS, PLOT_HEIGHT_PX, PLOT_LATENCY_BINS_PER_DECADE, PLOT_SOURCES_MAX, PLOT_WIDTH_PX
from kvledger.api.svg import (
    Scale,
    clock_label,
    count_ticks,
    decade_ticks,
    document,
    element,
    linear,
    logarithmic,
    time_ticks,
    titled,
)
from kvledger.ledger.audit import CODES
from kvledger.ledger.humanize import duration, utc
from kvledger.ledger.series import HoldingSeries, Point
from kvledger.ledger.sources import SourceHealth

LEFT_PX, TOP_PX, BOTTOM_PX = 58, 26, 30
LABELS_PX = 190
"""Room right of the held plot for each line's name (labels at the line ends read faster than a legend)."""
SOURCE_COLORS = (
    "#2563eb",
    "#16a34a",
    "#9333ea",
    "#0891b2",
    "#c2410c",
    "#4d7c0f",
    "#be185d",
    "#0f766e",
    "#7c3aed",
    "#a16207",
)
LOST_COLOR = "#6b7280"
LEAK_COLOR = "#dc2626"
CODE_COLORS = {
    "leak": "#dc2626",
    "double_owner": "#9333ea",
    "premature_release": "#be185d",
    "id_reuse": "#7f1d1d",
    "forged_message": "#111827",
    "stuck": "#f59e0b",
    "orphan_ack": "#ca8a04",
    "late_event": "#fb923c",
    "over_ack": "#a16207",
    "duplicate": "#9ca3af",
}
COMPLETED_COLOR, OTHER_COLOR = "#16a34a", "#ea580c"
TRANSFER_TIMEOUT_COLOR, DEFER_TIMEOUT_COLOR = "#7c3aed", "#dc2626"
LEAK_MARK_PX = 8
"""Leaks whose deadlines fall within this many pixels share one mark (with their count)."""
LABEL_GAP_PX = 13
LEGEND_INDENT_PX = 40
"""Legends sit in the top margin, right of the count axis' title."""
LATENCY_TOP_PX = 50
"""The latency plot's top margin holds its legend and the timeouts' labels, clear of the bars."""


def _frame(width: int, right_px: int, top_px: float = TOP_PX) -> tuple[float, float, float, float]:
    return LEFT_PX, width - right_px, top_px, PLOT_HEIGHT_PX - BOTTOM_PX


def _time_axis(lo: float, hi: float, x0: float, x1: float, y1: float) -> list[str]:
    scale = linear(lo, hi, x0, x1)
    ticks, digits = time_ticks(lo, hi)
    out = [element("line", x1=x0, x2=x1, y1=y1, y2=y1, stroke="#9ca3af")]
    for ts in ticks:
        x = scale(ts)
        out.append(element("line", x1=x, x2=x, y1=y1, y2=y1 + 4, stroke="#9ca3af"))
        out.append(element("text", clock_label(ts, digits), x=x, y=y1 + 16, class_="tick", text_anchor="middle"))
    out.append(
        element(
            "text",
            f"UTC, {utc(lo, digits=0, zone=False)[:10]}",
            x=x1,
            y=y1 + 28,
            class_="axis-title",
            text_anchor="end",
        )
    )
    return out


def _count_axis(hi: int, y_scale: Scale, x0: float, x1: float, label: str) -> list[str]:
    out = []
    for value in count_ticks(hi):
        y = y_scale(value)
        out.append(element("line", x1=x0, x2=x1, y1=y, y2=y, stroke="#f3f4f6" if value else "#9ca3af"))
        out.append(element("text", f"{value:,}", x=x0 - 6, y=y + 4, class_="tick", text_anchor="end"))
    out.append(element("text", label, x=x0 - 50, y=y_scale(hi) - 12, class_="axis-title"))
    return out


def _level_at(points: Sequence[Point], bucket_s: float, ts: float) -> int:
    """The source's level at `ts`: the peak of the bucket holding it, else the last level before it."""
    i = bisect.bisect_right([p.ts for p in points], ts) - 1
    if i < 0:
        return 0
    point = points[i]
    return point.peak if ts < point.ts + bucket_s else point.last


def _step_path(points: Sequence[Point], bucket_s: float, x: Scale, y: Scale, end_ts: float) -> str:
    """The peak of each bucket across its width (a spike is never smoothed away); where buckets are not
    adjacent, the level drops to the last one seen and holds until the next bucket or `end_ts`."""
    commands = [f"M{x(points[0].ts):.1f},{y(0):.1f}"]
    level, edge = 0, points[0].ts
    for p in points:
        if p.ts > edge + bucket_s / 2:  # a gap: nothing happened, so the level held
            commands.append(f"L{x(edge):.1f},{y(level):.1f}L{x(p.ts):.1f},{y(level):.1f}")
        right = min(p.ts + bucket_s, end_ts)
        commands.append(f"L{x(p.ts):.1f},{y(p.peak):.1f}L{x(right):.1f},{y(p.peak):.1f}")
        level, edge = p.last, right
    commands.append(f"L{x(edge):.1f},{y(level):.1f}L{x(end_ts):.1f},{y(level):.1f}")
    return "".join(commands)


def held_plot(
    series: HoldingSeries,
    health: Mapping[str, SourceHealth],
    leak_deadlines: Mapping[str, Sequence[float]],
    now: float,
) -> Markup:
    """Blocks held per source over the log's time; leaks as red marks at their deadlines; a lost source
    dashed from its last event on, a cross where it went silent, its passed deadlines in grey."""
    x0, x1, y0, y1 = _frame(PLOT_WIDTH_PX, LABELS_PX)
    label = "Blocks held over time, per source"
    lines = {source: series.points(source) for source in series.sources}
    lines = {source: points for source, points in lines.items() if points}
    if not lines or series.start_ts is None or series.end_ts is None:
        return _empty("plot-held", label, "no blocks were ever held")
    drawn = sorted(lines, key=lambda source: -max(p.peak for p in lines[source]))[:PLOT_SOURCES_MAX]
    lo = series.start_ts
    last_deadline = max((d for deadlines in leak_deadlines.values() for d in deadlines), default=lo)
    hi = max(series.end_ts + series.bucket_s, min(last_deadline, now), lo + 1e-3)
    top = max(1, max(p.peak for source in drawn for p in lines[source]))
    y_top = count_ticks(top * 1.1)[-1] if top > 4 else top + 1
    x, y = linear(lo, hi, x0, x1), linear(0, max(y_top, top), y1, y0)
    body = _count_axis(max(y_top, top), y, x0, x1, "blocks held") + _time_axis(lo, hi, x0, x1, y1)
    ends: list[tuple[float, str, str, str]] = []
    for i, source in enumerate(drawn):
        points, h = lines[source], health.get(source)
        color = SOURCE_COLORS[i % len(SOURCE_COLORS)]
        lost = h is not None and h.lost
        last_ts = min(h.last_ts, hi) if h is not None and lost else hi
        path = _step_path(points, series.bucket_s, x, y, last_ts)
        body.append(
            titled(
                element("path", d=path, fill="none", stroke=color, stroke_width=2),
                f"{source}: blocks held",
                class_="series",
                data_source=source,
            )
        )
        level = points[-1].last
        if lost and h is not None:
            body.append(
                element(
                    "path",
                    d=f"M{x(last_ts):.1f},{y(level):.1f}L{x(hi):.1f},{y(level):.1f}",
                    stroke=LOST_COLOR,
                    stroke_width=2,
                    stroke_dasharray="6,4",
                    fill="none",
                )
            )
            cross = f"M{x(last_ts) - 5:.1f},{y(level) - 5:.1f}l10,10m0,-10l-10,10"
            body.append(
                titled(
                    element("path", d=cross, stroke="#111827", stroke_width=2.5),
                    f"{source} went silent at {utc(h.last_ts)} holding {h.blocks_held:,} blocks: {h.why}",
                    class_="lost-mark",
                    data_source=source,
                )
            )
        for ts, count in _leak_marks(leak_deadlines.get(source, ()), x):
            at = y(_level_at(points, series.bucket_s, ts))
            triangle = f"M{x(ts):.1f},{at - 2:.1f}l-6,-10h12z"
            if lost:
                what = f"{count:,} deadlines on {source} passed after it went silent (lost with it, not leaked)"
            else:
                what = f"{count:,} leaks on {source}: deadline passed at {utc(ts)} with the blocks still held"
            body.append(
                titled(
                    element("path", d=triangle, fill=LOST_COLOR if lost else LEAK_COLOR),
                    what,
                    class_="lost-deadline" if lost else "leak-mark",
                    data_source=source,
                    data_count=count,
                )
            )
        state = f"lost, {h.blocks_held:,}" if lost and h is not None else f"{level:,} now"
        ends.append((y(level), source, state, LOST_COLOR if lost else color))
    body += _end_labels(ends, x1 + 8, y0, y1)
    if len(lines) > len(drawn):
        body.append(
            element(
                "text",
                f"{len(lines) - len(drawn)} smaller sources not drawn",
                x=x1,
                y=TOP_PX - 10,
                class_="note",
                text_anchor="end",
            )
        )
    return document("plot-held", PLOT_WIDTH_PX, PLOT_HEIGHT_PX, label, body)


def _leak_marks(deadlines: Sequence[float], x: Scale) -> list[tuple[float, int]]:
    """Deadlines grouped by the pixels they fall on: one mark with a count, however many leaks."""
    marks: dict[int, list[float]] = {}
    for deadline in deadlines:
        slot = marks.setdefault(int(x(deadline) // LEAK_MARK_PX), [deadline, 0])
        slot[1] += 1
    return [(first, int(count)) for first, count in marks.values()]


def _end_labels(ends: list[tuple[float, str, str, str]], x: float, y_min: float, y_max: float) -> list[str]:
    """Each line's name at its right end, nudged apart so that none overlap."""
    out, previous = [], y_min - LABEL_GAP_PX
    for y, source, state, color in sorted(ends):
        y = min(max(y + 4, previous + LABEL_GAP_PX), y_max + 20)
        previous = y
        out.append(element("text", f"{source} · {state}", x=x, y=y, fill=color, class_="end-label"))
    return out


def latency_plot(
    completed: Sequence[tuple[float, int]],
    everything: Sequence[tuple[float, int]],
    *,
    defer_timeout_s: float,
    transfer_timeout_s: float,
    p99_s: float | None,
) -> Markup:
    """How long sides held their blocks before release (log scale), completed releases apart from failed
    or expired ones, with both timeouts drawn: bars at a timeout line are releases the timeout made."""
    x0, x1, y0, y1 = _frame(PLOT_WIDTH_PX, 20, LATENCY_TOP_PX)
    label = "Release latency: first event to release"
    if not everything:
        return _empty("plot-latency", label, "no releases yet")
    per_decade = PLOT_LATENCY_BINS_PER_DECADE
    done, other = _bins(completed, per_decade), _bins(everything, per_decade)
    for b, n in done.items():
        other[b] -= n
    lo_bin, hi_bin = min(other), max(other)
    lo = 10 ** ((lo_bin - 1) / per_decade)
    hi = max(10 ** (hi_bin / per_decade), 1.4 * max(defer_timeout_s, transfer_timeout_s))
    x = logarithmic(lo, hi, x0, x1)
    top = max(done.get(b, 0) + other.get(b, 0) for b in other)
    y = linear(0, max(top, 1), y1, y0)
    body = _count_axis(max(top, 1), y, x0, x1, "releases")
    body.append(element("line", x1=x0, x2=x1, y1=y1, y2=y1, stroke="#9ca3af"))
    for value, text in decade_ticks(lo, hi):
        body.append(element("line", x1=x(value), x2=x(value), y1=y1, y2=y1 + 4, stroke="#9ca3af"))
        body.append(element("text", text, x=x(value), y=y1 + 16, class_="tick", text_anchor="middle"))
    for b in sorted(other):
        left, right = x(10 ** ((b - 1) / per_decade)) + 1, x(10 ** (b / per_decade)) - 1
        span = f"{duration(10 ** ((b - 1) / per_decade))} to {duration(10 ** (b / per_decade))}"
        segments = [(done.get(b, 0), COMPLETED_COLOR, "completed"), (other[b], OTHER_COLOR, "failed or expired")]
        body += _stack(left, right, y1, y, [
            (count, color, f"{count:,} {what} releases held {span}", {"class_": "latency-bar", "data_cause": what})
            for count, color, what in segments
        ])  # fmt: skip
    body += _vertical(
        x(transfer_timeout_s),
        y0,
        y1,
        f"transfer_timeout {duration(transfer_timeout_s)}",
        TRANSFER_TIMEOUT_COLOR,
        "timeout",
        "transfer",
        row=0,
    )
    body += _vertical(
        x(defer_timeout_s),
        y0,
        y1,
        f"defer_timeout {duration(defer_timeout_s)}",
        DEFER_TIMEOUT_COLOR,
        "timeout",
        "defer",
        row=1,
    )
    if p99_s is not None:
        body += _vertical(x(p99_s), y0, y1, f"p99 completed {duration(p99_s)}", COMPLETED_COLOR, "p99", "p99", row=2)
    body += _legend([("completed", COMPLETED_COLOR), ("failed or expired", OTHER_COLOR)], x0 + LEGEND_INDENT_PX, 4)
    body.append(element("text", "held for (log scale)", x=x1, y=y1 + 28, class_="axis-title", text_anchor="end"))
    return document("plot-latency", PLOT_WIDTH_PX, PLOT_HEIGHT_PX, label, body)


def _bins(buckets: Sequence[tuple[float, int]], per_decade: int) -> dict[int, int]:
    out: dict[int, int] = {}
    for upper_s, count in buckets:
        b = math.ceil(math.log10(max(upper_s, 1e-9)) * per_decade - 1e-9)
        out[b] = out.get(b, 0) + count
    return out


def _vertical(x: float, y0: float, y1: float, text: str, color: str, kind: str, name: str, row: int) -> list[str]:
    anchor = "end" if x > PLOT_WIDTH_PX - 160 else "start"
    shift = -4 if anchor == "end" else 4
    label_y = 14 + 13 * row
    return [
        element(
            "line",
            x1=x,
            x2=x,
            y1=label_y - 10,
            y2=y1,
            stroke=color,
            stroke_width=2,
            stroke_dasharray="6,3",
            class_=kind,
            data_name=name,
        ),
        element("text", text, x=x + shift, y=label_y, fill=color, class_="line-label", text_anchor=anchor),
    ]


def _legend(entries: list[tuple[str, str]], x: float, y: float) -> list[str]:
    out = []
    for text, color in entries:
        out.append(element("rect", x=x, y=y, width=10, height=10, fill=color))
        out.append(element("text", text, x=x + 14, y=y + 9, class_="legend"))
        x += 24 + 7 * len(text)
    return out


def findings_plot(
    times_by_code: Mapping[str, Sequence[float]], lost_times: Sequence[float], lo: float, hi: float
) -> Markup:
    """Findings by the time they became true, stacked by code; those on lost engines in grey."""
    x0, x1, y0, y1 = _frame(PLOT_WIDTH_PX, 20)
    label = "Findings over time, by code"
    total = sum(len(v) for v in times_by_code.values()) + len(lost_times)
    if not total:
        return _empty("plot-findings", label, "no findings")
    hi = max(hi, lo + 1e-3)
    width_s = (hi - lo) / PLOT_BARS
    stacks: list[tuple[str, str, Sequence[float]]] = [
        (code, CODE_COLORS[code], times_by_code[code]) for code in CODES if times_by_code.get(code)
    ]
    if lost_times:
        stacks.append(("on lost engines", LOST_COLOR, lost_times))
    bars: list[dict[str, int]] = [{} for _ in range(PLOT_BARS)]
    for name, _, times in stacks:
        for ts in times:
            i = min(PLOT_BARS - 1, max(0, int((ts - lo) / width_s)))
            bars[i][name] = bars[i].get(name, 0) + 1
    top = max(sum(bar.values()) for bar in bars)
    x, y = linear(lo, hi, x0, x1), linear(0, top, y1, y0)
    body = _count_axis(top, y, x0, x1, "findings") + _time_axis(lo, hi, x0, x1, y1)
    for i, bar in enumerate(bars):
        left, right = x(lo + i * width_s) + 1, x(lo + (i + 1) * width_s) - 1
        since = utc(lo + i * width_s)
        body += _stack(left, right, y1, y, [
            (bar.get(name, 0), color, f"{bar.get(name, 0):,} {name} from {since}",
             {"class_": "finding-bar", "data_code": name})
            for name, color, _ in stacks
        ])  # fmt: skip
    legend = [(f"{name} {len(times):,}", color) for name, color, times in stacks]
    body += _legend(legend, x0 + LEGEND_INDENT_PX, 4)
    return document("plot-findings", PLOT_WIDTH_PX, PLOT_HEIGHT_PX, label, body)


def _stack(
    left: float, right: float, base: float, y: Scale, segments: list[tuple[int, str, str, dict[str, object]]]
) -> list[str]:
    """One bar of stacked segments (count, color, title, attributes), bottom up; empty segments skipped."""
    out = []
    for count, color, title, attributes in segments:
        if count <= 0:
            continue
        top = base - (y(0) - y(count))
        rect = element("rect", x=left, y=top, width=max(right - left, 1), height=base - top, fill=color)
        out.append(titled(rect, title, **attributes))
        base = top
    return out


def _empty(plot_id: str, label: str, message: str) -> Markup:
    height = PLOT_HEIGHT_PX // 3
    body = [element("text", message, x=PLOT_WIDTH_PX / 2, y=height / 2 + 5, class_="empty", text_anchor="middle")]
    return document(plot_id, PLOT_WIDTH_PX, height, label, body)
