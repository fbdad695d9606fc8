"""A few lines of SVG writing: escaped elements, linear and log scales, ticks that fall on round values.

Plots are drawn on the server as inline SVG (no script, no charting library, nothing fetched): the page
works in a browser with no network, a screenshot shows exactly what an operator saw, and a test reads
the plot's elements like any other HTML.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from markupsafe import Markup, escape

from kvledger.ledger.humanize import duration, utc

TIME_STEPS_S: tuple[float, ...] = (
    0.001,
    0.002,
    0.005,
    0.01,
    0.02,
    0.05,
    0.1,
    0.2,
    0.5,
    1,
    2,
    5,
    10,
    15,
    30,
    60,
    120,
    300,
    600,
    900,
    1800,
    3600,
    7200,
    10800,
    21600,
    43200,
    86400,
    172800,
    604800,
)
"""Steps a time axis may take: round in the units people count in (seconds, minutes, hours, days)."""

Scale = Callable[[float], float]


def element(tag: str, text: str | None = None, /, *, inner: str = "", **attributes: object) -> str:
    """`<tag a="v">text</tag>`: attributes and text escaped, `inner` is markup written by these functions.
    `class_` is `class`; other underscores become dashes (`stroke_width`)."""
    parts = [tag]
    for name, value in attributes.items():
        if value is None:
            continue
        key = "class" if name == "class_" else name.replace("_", "-")
        shown = f"{value:.1f}" if isinstance(value, float) else str(value)
        parts.append(f'{key}="{escape(shown)}"')
    head = " ".join(parts)
    if text is None and not inner:
        return f"<{head}/>"
    return f"<{head}>{escape(text or '')}{inner}</{tag}>"


def titled(inner: str, title: str, **attributes: object) -> str:
    """A group with a hover title: what a mark means, in words."""
    return element("g", inner=element("title", title) + inner, **attributes)


def document(plot_id: str, width: int, height: int, label: str, body: list[str]) -> Markup:
    svg = element(
        "svg",
        inner="".join(body),
        id=plot_id,
        class_="plot",
        width=width,
        height=height,
        role="img",
        aria_label=label,
        xmlns="http://www.w3.org/2000/svg",
        viewBox=f"0 0 {width} {height}",
    )
    return Markup(svg)


def linear(lo: float, hi: float, px_lo: float, px_hi: float) -> Scale:
    span = hi - lo if hi > lo else 1.0

    def scale(value: float) -> float:
        return px_lo + (px_hi - px_lo) * (min(max(value, lo), hi) - lo) / span

    return scale


def logarithmic(lo: float, hi: float, px_lo: float, px_hi: float) -> Scale:
    inner = linear(math.log10(lo), math.log10(hi), px_lo, px_hi)
    return lambda value: inner(math.log10(max(value, lo)))


def time_ticks(lo: float, hi: float, count: int = 6) -> tuple[list[float], int]:
    """Round times between `lo` and `hi` (about `count` of them) and the digits of a second their labels need."""
    span = max(hi - lo, 1e-3)
    step = next((s for s in TIME_STEPS_S if span / s <= count), TIME_STEPS_S[-1])
    first = math.ceil(lo / step) * step
    ticks = [first + i * step for i in range(int((hi - first) / step) + 1)]
    digits = 0 if step >= 1 else 1 if step >= 0.1 else 2 if step >= 0.01 else 3
    return ticks, digits


def clock_label(ts: float, digits: int) -> str:
    return utc(ts, digits=digits, date=False, zone=False)


def count_ticks(hi: float, count: int = 4) -> list[int]:
    """0 and round counts up to `hi` (1, 2 or 5 times a power of ten apart)."""
    if hi <= 0:
        return [0]
    raw = hi / count
    power = 10 ** math.floor(math.log10(raw)) if raw >= 1 else 1
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    return list(range(0, int(hi) + 1, int(step)))


def decade_ticks(lo: float, hi: float) -> list[tuple[float, str]]:
    """Powers of ten between `lo` and `hi`, labelled as durations (`1 ms`, `10 ms`, `1 s`)."""
    return [(10.0**k, duration(10.0**k)) for k in range(math.ceil(math.log10(lo)), math.floor(math.log10(hi)) + 1)]
