"""The blocks-held series: bounded however long the log, every peak kept, the last level carried."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvledger.ledger.series import HoldingSeries


def test_peaks_survive_bucketing_and_the_level_after_them_is_the_last() -> None:
    series = HoldingSeries(points_max=10, bucket_s=1.0)
    for ts, held in [(0.0, 5), (0.2, 50), (0.4, 7), (3.5, 9)]:
        series.observe(ts, "p/tp0", held)
    points = series.points("p/tp0")
    assert [(p.ts, p.peak, p.last) for p in points] == [(0.0, 50, 7), (3.0, 9, 9)]


@given(st.lists(st.tuples(st.floats(0, 1e5), st.integers(0, 10_000)), min_size=1, max_size=300))
def test_bounded_and_the_highest_peak_is_kept(observations: list[tuple[float, int]]) -> None:
    series = HoldingSeries(points_max=16, bucket_s=0.01)
    ordered = sorted(observations)
    for ts, held in ordered:
        series.observe(ts, "s", held)
    points = series.points("s")
    assert 1 <= len(points) <= 16
    assert max(p.peak for p in points) == max(held for _, held in ordered)
    assert points[-1].last == ordered[-1][1]
    assert series.start_ts == ordered[0][0] and series.end_ts == ordered[-1][0]
