"""The page's first lines: what is wrong, in sentences, worst first; the all-clear only when it is one.

`headline` is the same verdict in one line: the page's title, its favicon's colour and its first line all
come from it, so a tab bar never reads "0 leaks" over a page that cannot vouch for its ledger.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import quote

from kvledger.api.board import Board
from kvledger.api.trust import Problem
from kvledger.ledger.audit import CODES
from kvledger.ledger.humanize import ago, duration, utc


@dataclass(frozen=True)
class Line:
    level: str
    """`bad` (act now), `warn` (look soon), `lost` (an engine is gone), `unknown` (the page cannot vouch),
    `ok` (all clear)."""
    text: str


def _plural(count: int, word: str) -> str:
    return f"{count:,} {word}{'' if count == 1 else 's'}"


def _listed(counts: dict[str, int], severity: str) -> str:
    return ", ".join(f"{code} {n:,}" for code, n in counts.items() if n and CODES[code] == severity)


@dataclass(frozen=True)
class Headline:
    level: str
    """The worst of the verdict's levels: `bad`, `unknown`, `lost`, `warn` or `ok`."""
    text: str

    @property
    def colour(self) -> str:
        return LEVEL_COLOURS[self.level]

    @property
    def favicon(self) -> str:
        """A filled circle in the level's colour, as a data URI: the tab shows the verdict before it is read."""
        svg = (
            "<svg xmlns='http://www.w3.org/2000/svg' viewBox='0 0 16 16'>"
            f"<circle cx='8' cy='8' r='7' fill='{self.colour}'/></svg>"
        )
        return "data:image/svg+xml," + quote(svg, safe="/:='")


LEVEL_COLOURS = {"bad": "#dc2626", "unknown": "#ea580c", "lost": "#6b7280", "warn": "#d97706", "ok": "#16a34a"}
"""One colour per level, for the favicon and the dot before the page's first line. Unknown is orange, apart
from both red and green: the page can vouch for neither."""


def _live_findings(board: Board) -> tuple[int, int, int]:
    """(leaks, other errors, warnings) on live engines."""
    counts = board.live_counts
    leaks = counts["leak"]
    errors = sum(n for code, n in counts.items() if CODES[code] == "error") - leaks
    warnings = sum(n for code, n in counts.items() if CODES[code] == "warning")
    return leaks, errors, warnings


def headline(board: Board, problems: list[Problem]) -> Headline:
    """The verdict in one line. With a problem, a count is of what could be read and the rest is not known:
    a zero is never said then."""
    leaks, errors, warnings = _live_findings(board)
    found = ", ".join(
        _plural(n, word) for n, word in ((leaks, "leak"), (errors, "other error"), (warnings, "warning")) if n
    )
    lost = f"{_plural(len(board.lost), 'engine')} lost" if board.lost else ""
    said = "; ".join(part for part in (f"{found} on live engines" if found else "", lost) if part)
    if problems:
        if not said:
            return Headline("unknown", "Not known whether anything is wrong")
        return Headline("bad" if leaks or errors else "unknown", f"{said} in what could be read; the rest is not known")
    if leaks or errors:
        return Headline("bad", said)
    if board.lost:
        return Headline("lost", said if warnings else f"{said}; nothing wrong on live engines")
    if warnings:
        return Headline("warn", said)
    return Headline("ok", "All clear: nothing leaked, stuck or out of order")


def verdict(board: Board, problems: list[Problem]) -> list[Line]:
    lines: list[Line] = []
    counts = board.live_counts
    leaks, errors, warnings = _live_findings(board)
    if leaks:
        blocks = sum(g.blocks for g in board.live_groups if g.code == "leak")
        lines.append(
            Line(
                "bad",
                f"{_plural(leaks, 'leak')} on live engines: {blocks:,} blocks held past their "
                "deadline with no decision.",
            )
        )
    if errors:
        lines.append(Line("bad", f"{_plural(errors, 'other error')} on live engines: {_listed(counts, 'error')}."))
    for engine in board.lost:
        lines.append(
            Line(
                "lost",
                f"Engine {engine.engine} is lost, {engine.why}. Its last event was at {utc(engine.last_ts)} "
                f"({ago(engine.last_ts, board.now)}); the {engine.blocks:,} blocks of its "
                f"{_plural(engine.sides, 'transfer side')} went with it: lost, not leaked.",
            )
        )
    if warnings:
        lines.append(Line("warn", f"{_plural(warnings, 'warning')} on live engines: {_listed(counts, 'warning')}."))
    if leaks or errors or warnings:
        return lines
    if problems:
        lines.append(
            Line(
                "unknown",
                "Not known whether anything is wrong: the audit covers only what could be read, and nothing in "
                "that is wrong. See the problems above.",
            )
        )
        return lines
    held = (
        f"{_plural(board.sides_live, 'transfer side')} in flight hold {board.blocks_live:,} blocks"
        if board.sides_live
        else "nothing is held"
    )
    live_sources = sum(1 for h in board.sources if not h.lost)
    lines.append(
        Line("ok", f"Live engines ({_plural(live_sources, 'source')}): nothing leaked, stuck or out of order; {held}.")
    )
    return lines


def activity(board: Board, problems: list[Problem]) -> str:
    """What the ledger holds, in one sentence: the events, their time span, and how transfers ended."""
    if not board.events or board.newest_ts is None:
        return "Nothing has been read from the store." if problems else "The ledger holds no events yet."
    sources = len(board.sources)
    span = ""
    if board.first_ts is not None:
        span = f", {utc(board.first_ts)} to {utc(board.newest_ts)} ({duration(board.newest_ts - board.first_ts)})"
    causes = board.releases_by_cause
    released = sum(causes.values())
    how = ", ".join(f"{cause} {n:,}" for cause, n in causes.items() if n)
    return (
        f"The ledger holds {board.events:,} events from {_plural(sources, 'source')}{span}; "
        f"{released:,} transfer sides were released" + (f" ({how})." if how else ".")
    )
