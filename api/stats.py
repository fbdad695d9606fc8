"""Release latencies for the summary: a bounded window of recent ones, percentiles, the timeout advice."""

from __future__ import annotations

from collections import deque

from ledger.decisions import Release

PERCENTILES: tuple[int, ...] = (50, 90, 99)


class LatencyWindow:
    """The most recent release latencies (seconds from a side's first event to its decision), by cause."""

    def __init__(self, samples_max: int) -> None:
        self.completed: deque[float] = deque(maxlen=samples_max)
        self.all: deque[float] = deque(maxlen=samples_max)

    def observe(self, release: Release, first_ts: float) -> float:
        latency_s = max(0.0, release.ts - first_ts)
        self.all.append(latency_s)
        if release.cause == "completed":
            self.completed.append(latency_s)
        return latency_s


def percentiles(samples: deque[float] | list[float]) -> dict[str, float | None]:
    """Nearest-rank percentiles (`p50`, `p90`, `p99`); None when there are no samples."""
    ordered = sorted(samples)
    out: dict[str, float | None] = {}
    for p in PERCENTILES:
        if not ordered:
            out[f"p{p}"] = None
            continue
        rank = max(1, -(-p * len(ordered) // 100))  # ceil without floats
        out[f"p{p}"] = ordered[rank - 1]
    return out


def timeout_advice(p99_s: float | None, defer_timeout_s: float, late_after_expire: int) -> str:
    """One sentence an SRE can act on: is the configured defer timeout sane for what we observe?"""
    if late_after_expire:
        return (
            f"{late_after_expire} transfers saw events after they expired: defer_timeout "
            f"{defer_timeout_s:g}s is too short for this traffic; raise it"
        )
    if p99_s is None:
        return "no completed releases observed yet: no advice"
    if p99_s > 0.5 * defer_timeout_s:
        return (
            f"p99 release latency {p99_s:.3f}s is over half of defer_timeout {defer_timeout_s:g}s: "
            "slow releases will soon be expired; raise the timeout or find the slow peer"
        )
    return (
        f"p99 release latency {p99_s:.3f}s is well under defer_timeout {defer_timeout_s:g}s: "
        "the timeout is safe (leaks are held for the whole timeout before reclaim)"
    )
