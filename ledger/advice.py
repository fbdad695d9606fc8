"""Timeout advice: what the observed map-to-release latencies say about the configured timeouts.

Latencies go into fixed log-scale histograms as releases are decided, so the
advice over a 10M-event replay costs a few kilobytes, not a list per release.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from kvledger.ledger.audit import Finding
from kvledger.ledger.decisions import Release
from kvledger.ledger.fold import LedgerState
from kvledger.ledger.humanize import duration
from kvledger.ledger.limits import DEFAULT_DEFER_TIMEOUT_S, DEFAULT_TRANSFER_TIMEOUT_S
from kvledger.ledger.side import TransferState

BUCKET_RATIO = 1.02
"""Each histogram bucket is 2% wider than the last: percentiles are within 2%."""
BUCKET_MIN_S = 1e-6
_LOG_RATIO = math.log(BUCKET_RATIO)
"""`math.log(x, BUCKET_RATIO)` is `math.log(x) / math.log(BUCKET_RATIO)`: the divisor, computed once."""


HistogramPlain = tuple[list[tuple[int, int]], int, float]
"""A LatencyHistogram as plain data (`to_plain`)."""
RecorderPlain = tuple[list[tuple[str, HistogramPlain]], HistogramPlain, HistogramPlain, int, float]
"""A LatencyRecorder as plain data (`to_plain`)."""


_MIN_S = BUCKET_MIN_S
"""`BUCKET_MIN_S` as the compiled module reads it (a C double: ledger/advice.pxd)."""


def _bucket(value_s: float) -> int:
    """The histogram bucket of a latency."""
    if value_s <= _MIN_S:
        return 0
    return 1 + int(math.log(value_s / _MIN_S) / _LOG_RATIO)  # compiled: C's log (advice.pxd)


class LatencyHistogram:
    """Counts of latencies in log-scale buckets; exact count, min and max.

    Compiled (ledger/advice.pxd), this and `LatencyRecorder` are extension types: a replay records
    every release, and their fields and `add_in` are then C."""

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}
        self.count = 0
        self.max_s = 0.0

    @staticmethod
    def _upper(bucket: int) -> float:
        return BUCKET_MIN_S * BUCKET_RATIO**bucket

    def add(self, value_s: float) -> None:
        self.add_in(_bucket(value_s), value_s)

    def add_in(self, bucket: int, value_s: float) -> None:
        """`add`, with the bucket already computed (one release lands in several histograms)."""
        counts = self.counts
        counts[bucket] = counts.get(bucket, 0) + 1
        self.count += 1
        if value_s > self.max_s:
            self.max_s = value_s

    def to_plain(self) -> HistogramPlain:
        """Its counts (in bucket order), count and max: what a snapshot writes."""
        return (list(self.counts.items()), self.count, self.max_s)

    @classmethod
    def from_plain(cls, plain: HistogramPlain) -> LatencyHistogram:
        histogram = cls()
        counts, histogram.count, histogram.max_s = plain
        histogram.counts = dict(counts)
        return histogram

    def percentile(self, q: float) -> float | None:
        """The upper edge of the bucket holding the q-th percentile (never above the max)."""
        if not self.count:
            return None
        rank = max(1, math.ceil(q / 100.0 * self.count))
        seen = 0
        for bucket in sorted(self.counts):
            seen += self.counts[bucket]
            if seen >= rank:
                return min(self._upper(bucket), self.max_s)
        return self.max_s

    def buckets(self) -> list[tuple[float, int]]:
        """(upper edge in seconds, count) of every bucket holding something, shortest first: what a plot draws."""
        return [(self._upper(bucket), self.counts[bucket]) for bucket in sorted(self.counts)]

    def count_above(self, threshold_s: float) -> int:
        """Latencies above `threshold_s` (to bucket resolution)."""
        edge = _bucket(threshold_s)
        return sum(n for bucket, n in self.counts.items() if bucket > edge)


class LatencyRecorder:
    """Feed it each release with its side's state at decision time; it keeps the advice's inputs."""

    def __init__(self) -> None:
        self.by_kind: dict[str, LatencyHistogram] = {}
        """Completed releases by `role/mode`."""
        self.completed = LatencyHistogram()
        self.all_causes = LatencyHistogram()
        self.expired_releases = 0
        self.expired_block_seconds = 0.0

    def to_plain(self) -> RecorderPlain:
        """Every histogram and count as plain data, orders kept: what a snapshot writes."""
        return (
            [(kind, histogram.to_plain()) for kind, histogram in self.by_kind.items()],
            self.completed.to_plain(),
            self.all_causes.to_plain(),
            self.expired_releases,
            self.expired_block_seconds,
        )

    @classmethod
    def from_plain(cls, plain: RecorderPlain) -> LatencyRecorder:
        recorder = cls()
        by_kind, completed, all_causes, recorder.expired_releases, recorder.expired_block_seconds = plain
        recorder.by_kind = {kind: LatencyHistogram.from_plain(h) for kind, h in by_kind}
        recorder.completed = LatencyHistogram.from_plain(completed)
        recorder.all_causes = LatencyHistogram.from_plain(all_causes)
        return recorder

    def observe(self, release: Release, side: TransferState) -> float:
        """Record one release; returns how long its side held the blocks (seconds)."""
        held_s = release.ts - side.first_ts
        if held_s < 0.0:
            held_s = 0.0
        return self.record(release, held_s)

    def record(self, release: Release, held_s: float) -> float:
        """Record one release whose side held its blocks `held_s` seconds (`observe`'s measure, taken where
        the side was: a merge of partitions records each release again, in fold order). Returns `held_s`."""
        bucket = _bucket(held_s)
        self.all_causes.add_in(bucket, held_s)
        cause = release.cause
        if cause == "completed":
            self.completed.add_in(bucket, held_s)
            kind = f"{release.role}/{release.mode}"
            histogram = self.by_kind.get(kind)
            if histogram is None:
                histogram = self.by_kind[kind] = LatencyHistogram()
            histogram.add_in(bucket, held_s)
        elif cause == "expired":
            self.expired_releases += 1
            self.expired_block_seconds += held_s * len(release.block_ids)
        return held_s


def percentiles(histogram: LatencyHistogram, points: tuple[int, ...] = (50, 90, 99)) -> dict[str, float | None]:
    """`{"p50": ..., "p90": ..., "p99": ...}`; None where nothing was observed."""
    return {f"p{p}": histogram.percentile(float(p)) for p in points}


def verdict(p99_s: float | None, defer_timeout_s: float, late_after_expire: int = 0) -> str:
    """One sentence an SRE can act on: is the configured timeout sane for what was observed?"""
    if late_after_expire:
        return (
            f"{late_after_expire} transfer{'s' if late_after_expire != 1 else ''} saw events after they expired: "
            "defer_timeout "
            f"{duration(defer_timeout_s)} is too short for this traffic; raise it"
        )
    if p99_s is None:
        return "no completed releases observed yet: no advice"
    if p99_s > 0.5 * defer_timeout_s:
        return (
            f"p99 completed-release latency {duration(p99_s)} is over half of defer_timeout "
            f"{duration(defer_timeout_s)}: slow releases will soon be expired; raise the timeout or find the slow peer"
        )
    return (
        f"p99 completed-release latency {duration(p99_s)} is well under defer_timeout {duration(defer_timeout_s)}:"
        " the timeout is safe (a leak is held for the whole timeout before it is reclaimed)"
    )


def timeout_advice(
    recorder: LatencyRecorder,
    *,
    defer_timeout_s: float = DEFAULT_DEFER_TIMEOUT_S,
    transfer_timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S,
    late_after_expire: int = 0,
) -> dict[str, Any]:
    """Per role/mode: latency p50/p99/max; how many releases a shorter timeout would have turned
    into expires followed by late acks; block-seconds pinned by transfers that did expire."""
    kinds: dict[str, Any] = {}
    for kind, histogram in sorted(recorder.by_kind.items()):
        configured = defer_timeout_s if kind == "producer/read" else transfer_timeout_s
        p99 = histogram.percentile(99.0) or 0.0
        candidates = sorted({round(configured / 2, 3), round(configured / 4, 3), round(p99, 3)})
        kinds[kind] = {
            "count": histogram.count,
            "p50_s": histogram.percentile(50.0),
            "p99_s": p99,
            "max_s": histogram.max_s,
            "configured_timeout_s": configured,
            "late_if_timeout_s": {str(c): histogram.count_above(c) for c in candidates if c > 0},
        }
    return {
        "defer_timeout_s": defer_timeout_s,
        "transfer_timeout_s": transfer_timeout_s,
        "by_kind": kinds,
        "expired_releases": recorder.expired_releases,
        "expired_block_seconds": round(recorder.expired_block_seconds, 3),
        "late_after_expire": late_after_expire,
        "verdict": verdict(recorder.completed.percentile(99.0), defer_timeout_s, late_after_expire),
    }


def late_after_expire(state: LedgerState, findings: Iterable[Finding]) -> int:
    """Sides released by expire that still saw events: the sign the timeout is shorter than the traffic."""
    count = 0
    for f in findings:
        if f.code != "late_event":
            continue
        side = state.transfers.get((f.source, f.transfer_id))
        if side is not None and side.decision is not None and side.decision.cause == "expired":
            count += 1
    return count
