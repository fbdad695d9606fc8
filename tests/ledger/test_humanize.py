"""Durations and times for people: two units at most, rounding that never shows `60 s` or `60 min`, UTC."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvledger.ledger.humanize import ago, duration, iso, offset, utc


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0 s"), (3e-7, "0.3 µs"), (3.5e-4, "350 µs"), (0.0012, "1.2 ms"), (0.0123, "12 ms"), (0.9996, "1 s"),
     (1.23, "1.2 s"), (12.4, "12 s"), (59.6, "1 min"), (250, "4 min 10 s"), (3599.7, "1 h"), (10800, "3 h"),
     (11100, "3 h 5 min"), (86399, "1 d"), (96111027, "1112 d 10 h"), (-2, "-2 s")],
)  # fmt: skip
def test_the_issue_examples_and_the_rounding_edges(seconds: float, text: str) -> None:
    assert duration(seconds) == text


SHAPE = re.compile(r"^-?(\d+(\.\d)? (µs|ms|s)|\d+ min( \d+ s)?|\d+ h( \d+ min)?|\d+ d( \d+ h)?)$")


@given(st.floats(min_value=-1e9, max_value=1e9, allow_nan=False))
def test_every_duration_has_a_readable_shape(seconds: float) -> None:
    text = duration(seconds)
    assert SHAPE.match(text), text
    assert not re.search(r"\b60 (s|min)\b|\b24 h\b|\b1000 (µs|ms)\b", text), text


@given(st.floats(min_value=0, max_value=1e6), st.floats(min_value=0, max_value=1e6))
def test_longer_durations_never_read_shorter(a: float, b: float) -> None:
    """Order is kept to the precision shown: parse the text back and compare."""
    units = {"µs": 1e-6, "ms": 1e-3, "s": 1, "min": 60, "h": 3600, "d": 86400}

    def back(text: str) -> float:
        parts = text.split()
        return sum(float(n) * units[u] for n, u in zip(parts[::2], parts[1::2], strict=True))

    low, high = sorted((a, b))
    assert back(duration(low)) <= back(duration(high)) * (1 + 1e-9)


def test_times_are_utc_with_the_zone_written() -> None:
    assert utc(1_700_000_000.123456) == "2023-11-14 22:13:20.123 UTC"
    assert utc(1_700_000_000.5, digits=0, date=False, zone=False) == "22:13:20"
    assert iso(1_700_000_000.5) == "2023-11-14T22:13:20.500Z"
    assert "not a printable date" in utc(1e12) and iso(1e12) == ""
    assert offset(0) == "+0 s" and offset(1.5) == "+1.5 s" and offset(-90) == "-1 min 30 s"
    assert ago(10, 100) == "1 min 30 s ago" and ago(100, 10) == "in 1 min 30 s" and ago(5, 5) == "now"
