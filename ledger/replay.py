"""Fold recorded logs offline, optionally up to a moment of the incident (time travel)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ledger.advice import LatencyRecorder
from ledger.decisions import Release
from ledger.events import Event
from ledger.fold import LedgerState
from ledger.limits import REPLAY_COMPACT_EVERY, REPLAY_RETAIN_S


@dataclass
class ReplayResult:
    state: LedgerState
    latencies: LatencyRecorder = field(default_factory=LatencyRecorder)
    releases: list[Release] = field(default_factory=list)
    """Every decision in order; left empty when the caller does not keep them."""
    release_count: int = 0
    events: int = 0
    first_ts: float | None = None
    last_ts: float | None = None
    stopped_early: bool = False


def replay(
    events: Iterable[Event],
    *,
    until_seq: int | None = None,
    until_ts: float | None = None,
    on_progress: Callable[[int], None] | None = None,
    compact_every: int | None = REPLAY_COMPACT_EVERY,
    keep_releases: bool = True,
) -> ReplayResult:
    """Fold `events` into a fresh state, leaving out events after `until_ts` or past `until_seq` (per source).

    The state is fresh and private: an error while reading leaves nothing half-applied
    anywhere else. Every `compact_every` events (rounded down to a power of two), cleanly released sides are compacted
    away once their last event is `REPLAY_RETAIN_S` older than the newest (their counts
    kept), so memory follows live transfers, not log length; sides with audit evidence
    are kept.
    """
    result = ReplayResult(LedgerState())
    state = result.state
    apply = state.apply
    observe = result.latencies.observe
    releases = result.releases
    release_count = 0
    n = 0
    first_ts: float | None = None
    last_ts = float("-inf")
    compact_mask = (1 << max(0, (compact_every or 1).bit_length() - 1)) - 1
    for event in events:
        if until_ts is not None and event.ts > until_ts:
            result.stopped_early = True
            continue  # not break: one source's clock may step back past the cut
        if until_seq is not None and event.seq > until_seq:
            result.stopped_early = True
            continue
        release = apply(event)
        if release is not None:
            release_count += 1
            observe(release, state.transfers[(release.source, release.transfer_id)])
            if keep_releases:
                releases.append(release)
        n += 1
        if event.ts > last_ts:
            last_ts = event.ts
        if not n & compact_mask:
            if first_ts is None:
                first_ts = event.ts
            if compact_every is not None:
                state.compact(clean_only=True, decided_before_ts=last_ts - REPLAY_RETAIN_S)
            if on_progress is not None:
                on_progress(n)
        elif n == 1:
            first_ts = event.ts
    result.events, result.first_ts, result.last_ts = n, first_ts, (last_ts if n else None)
    result.release_count = release_count
    return result
