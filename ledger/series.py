"""Blocks held per source over log time, in a bounded number of buckets: what a plot of holdings draws.

Fed as the fold goes (`observe` after each map or release), so a plot never refolds or rereads the log.
Each bucket keeps the peak and the last value seen in it: the peak so a short spike is never smoothed
away, the last so an empty bucket after it carries the right level. When the log's span outgrows
`SERIES_POINTS_MAX` buckets, the width doubles and neighbours merge (peak of both, last of the later):
memory is bounded however long the log, and the resolution is the finest that fits.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvledger.ledger.limits import SERIES_BUCKET_MIN_S, SERIES_POINTS_MAX


@dataclass(frozen=True)
class Point:
    ts: float
    """The bucket's start."""
    peak: int
    last: int


SeriesPlain = tuple[int, float, float | None, float | None, list[tuple[str, list[tuple[int, int, int]]]]]
"""A HoldingSeries as plain data (`to_plain`): bounds, width, span, and each source's (index, peak, last)."""


class HoldingSeries:
    """Compiled (ledger/series.pxd), an extension type: its fields are declared there."""

    def __init__(self, points_max: int = SERIES_POINTS_MAX, bucket_s: float = SERIES_BUCKET_MIN_S) -> None:
        if points_max < 2 or bucket_s <= 0:
            raise ValueError("a series needs at least two buckets of a positive width")
        self.points_max = points_max
        self.bucket_s = bucket_s
        self.start_ts: float | None = None
        self.end_ts: float | None = None
        self._buckets: dict[str, dict[int, list[int]]] = {}
        """source -> bucket index -> [peak, last]"""

    def observe(self, ts: float, source: str, held: int) -> None:
        """`source` holds `held` blocks from `ts` on."""
        if self.start_ts is None:
            self.start_ts = ts
        start = self.start_ts
        if self.end_ts is None or ts > self.end_ts:
            self.end_ts = ts
        index = int((ts - start) / self.bucket_s) if ts > start else 0  # an earlier event lands in the first
        if index >= self.points_max:
            index = self._widen(index)
        buckets = self._buckets.get(source)
        if buckets is None:
            buckets = self._buckets[source] = {}
        bucket = buckets.get(index)
        if bucket is None:
            buckets[index] = [held, held]
        else:
            if held > bucket[0]:
                bucket[0] = held
            bucket[1] = held

    def _widen(self, index: int) -> int:
        """Double the width until `index` fits; returns it in the new width."""
        while index >= self.points_max:
            self.bucket_s *= 2
            index //= 2
            for source, buckets in self._buckets.items():
                merged: dict[int, list[int]] = {}
                for old in sorted(buckets):
                    peak, last = buckets[old]
                    target = merged.get(old // 2)
                    if target is None:
                        merged[old // 2] = [peak, last]
                    else:
                        target[0] = max(target[0], peak)
                        target[1] = last  # sorted: the later bucket's level is the merged one's
                self._buckets[source] = merged
        return index

    def to_plain(self) -> SeriesPlain:
        """Everything it holds, orders kept: what a snapshot writes."""
        buckets = [(source, [(i, peak, last) for i, (peak, last) in b.items()]) for source, b in self._buckets.items()]
        return (self.points_max, self.bucket_s, self.start_ts, self.end_ts, buckets)

    @classmethod
    def from_plain(cls, plain: SeriesPlain) -> HoldingSeries:
        points_max, bucket_s, start_ts, end_ts, buckets = plain
        series = cls(points_max, bucket_s)
        series.start_ts, series.end_ts = start_ts, end_ts
        series._buckets = {source: {i: [peak, last] for i, peak, last in b} for source, b in buckets}
        return series

    @property
    def sources(self) -> list[str]:
        return list(self._buckets)

    def points(self, source: str) -> list[Point]:
        """The source's buckets in time order (only those with an event; the level holds in between)."""
        start = self.start_ts or 0.0
        buckets = self._buckets.get(source, {})
        return [Point(start + i * self.bucket_s, *buckets[i]) for i in sorted(buckets)]
