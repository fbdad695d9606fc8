"""Times and durations written for people: the one formatter the page, the CLI tables and every time axis use.

Durations keep two significant units at most (`1.2 s`, `4 min 10 s`, `3 h`, `2 d 4 h`), so a column of
them reads at a glance; absolute times are UTC with the zone written out (`2025-05-01 12:00:03.120 UTC`),
because a ledger merges machines whose local zones differ.
"""

from __future__ import annotations

from datetime import UTC, datetime

from kvledger.ledger.limits import TS_MAX  # the last second `datetime` can write

_MINUTE_S, _HOUR_S, _DAY_S = 60, 3600, 86400


def duration(seconds: float) -> str:
    """`350 µs`, `12 ms`, `1.2 s`, `42 s`, `4 min 10 s`, `3 h`, `2 d 4 h`; negative durations get a minus sign."""
    if seconds != seconds:  # NaN: say so rather than print a number that is not one
        return "unknown"
    if seconds in (float("inf"), float("-inf")):
        return "forever" if seconds > 0 else "-forever"  # an odd event's time; never a crash on a page
    if seconds < 0:
        return "-" + duration(-seconds)
    if seconds == 0:
        return "0 s"
    if seconds < 1e-3:
        return f"{_two_digits(seconds * 1e6)} µs" if seconds < 0.9995e-3 else "1 ms"
    if seconds < 1:
        return f"{_two_digits(seconds * 1e3)} ms" if seconds < 0.9995 else "1 s"
    if seconds < 9.95:
        return f"{_two_digits(seconds)} s"
    # Round to the smallest unit shown first, then pick the units: 3599.7 s is `1 h`, not `60 min`.
    whole = round(seconds)
    if whole < _MINUTE_S:
        return f"{whole} s"
    if whole < _HOUR_S:
        return _two_units(whole, _MINUTE_S, "min", 1, "s")
    minutes = round(seconds / _MINUTE_S) * _MINUTE_S
    if minutes < _DAY_S:
        return _two_units(minutes, _HOUR_S, "h", _MINUTE_S, "min")
    return _two_units(round(seconds / _HOUR_S) * _HOUR_S, _DAY_S, "d", _HOUR_S, "h")


def _two_digits(value: float) -> str:
    """One decimal below 10 (`1.2`), none above (`120`): two significant digits or more."""
    return _trim(f"{value:.1f}") if value < 9.95 else f"{value:.0f}"


def _trim(number: str) -> str:
    return number[:-2] if number.endswith(".0") else number


def _two_units(seconds: int, big_s: int, big: str, small_s: int, small: str) -> str:
    high, rest = divmod(seconds, big_s)
    low = rest // small_s
    return f"{high} {big} {low} {small}" if low else f"{high} {big}"


def offset(seconds: float) -> str:
    """A time relative to a start, for axes and tables: `+0 s`, `+1.2 s`, `+4 min 10 s`."""
    return ("-" if seconds < 0 else "+") + duration(abs(seconds))


def utc(ts: float, *, digits: int = 3, date: bool = True, zone: bool = True) -> str:
    """`2025-05-01 12:00:03.120 UTC`; `digits` of a second (0, 3 or 6), the date and the zone optional."""
    if not 0 <= ts <= TS_MAX:
        return f"{ts:.3f} s since the epoch (not a printable date)"
    moment = datetime.fromtimestamp(ts, UTC)
    text = moment.strftime("%Y-%m-%d %H:%M:%S" if date else "%H:%M:%S")
    if digits:
        text += f".{moment.microsecond:06d}"[: digits + 1]
    return f"{text} UTC" if zone else text


def iso(ts: float) -> str:
    """ISO 8601 for machines (an HTML `<time datetime>`): `2025-05-01T12:00:03.120Z`."""
    if not 0 <= ts <= TS_MAX:
        return ""
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def ago(ts: float, now: float) -> str:
    """`12 s ago`, `3 h ago`; `in 5 s` for a time after `now`; `now` when they are the same."""
    gap = now - ts
    if abs(gap) < 1e-3:
        return "now"
    return f"{duration(gap)} ago" if gap > 0 else f"in {duration(-gap)}"
