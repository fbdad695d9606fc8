"""Timeout advice: what the observed map-to-release latencies say about the configured timeouts.

Latencies go into fixed log-scale histograms as releases are decided, so the
advice over a 10M-event replay costs a few kilobytes, not a list per release.
"""

from __future__ import annotations

import math
from typing import Any

from ledger.decisions import Release
from ledger.fold import TransferState
from ledger.limits import DEFAULT_DEFER_TIMEOUT_S, DEFAULT_TRANSFER_TIMEOUT_S

BUCKET_RATIO = 1.02
"""Each histogram bucket is 2% wider than the last: percentiles are within 2%."""
BUCKET_MIN_S = 1e-6


class LatencyHistogram:
    """Counts of latencies in log-scale buckets; exact count, min and max."""

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}
        self.count = 0
        self.max_s = 0.0

    @staticmethod
    def _bucket(value_s: float) -> int:
        if value_s <= BUCKET_MIN_S:
            return 0
        return 1 + int(math.log(value_s / BUCKET_MIN_S, BUCKET_RATIO))

    @staticmethod
    def _upper(bucket: int) -> float:
        return BUCKET_MIN_S * BUCKET_RATIO**bucket

    def add(self, value_s: float) -> None:
        bucket = self._bucket(value_s)
        self.counts[bucket] = self.counts.get(bucket, 0) + 1
        self.count += 1
        self.max_s = max(self.max_s, value_s)

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

    def count_above(self, threshold_s: float) -> int:
        """Latencies above `threshold_s` (to bucket resolution)."""
        edge = self._bucket(threshold_s)
        return sum(n for bucket, n in self.counts.items() if bucket > edge)


class LatencyRecorder:
    """Feed it each release with its side's state at decision time; it keeps the advice's inputs."""

    def __init__(self) -> None:
        self.by_kind: dict[str, LatencyHistogram] = {}
        self.expired_releases = 0
        self.expired_block_seconds = 0.0

    def observe(self, release: Release, side: TransferState) -> None:
        held_s = max(0.0, release.ts - side.first_ts)
        if release.cause == "completed":
            kind = f"{release.role}/{release.mode}"
            histogram = self.by_kind.get(kind)
            if histogram is None:
                histogram = self.by_kind[kind] = LatencyHistogram()
            histogram.add(held_s)
        elif release.cause == "expired":
            self.expired_releases += 1
            self.expired_block_seconds += held_s * len(release.block_ids)


def timeout_advice(
    recorder: LatencyRecorder,
    *,
    defer_timeout_s: float = DEFAULT_DEFER_TIMEOUT_S,
    transfer_timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S,
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
    worst_p99 = max((k["p99_s"] for k in kinds.values()), default=0.0)
    if not kinds:
        verdict = "no completed transfers to learn from"
    elif worst_p99 > 0.8 * min(defer_timeout_s, transfer_timeout_s):
        verdict = "p99 release latency is close to a timeout: raise it or expect late acks after expires"
    else:
        verdict = "timeouts leave headroom over the observed p99 latency"
    return {
        "defer_timeout_s": defer_timeout_s,
        "transfer_timeout_s": transfer_timeout_s,
        "by_kind": kinds,
        "expired_releases": recorder.expired_releases,
        "expired_block_seconds": round(recorder.expired_block_seconds, 3),
        "verdict": verdict,
    }
