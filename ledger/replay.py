"""Fold recorded logs offline, optionally up to a moment of the incident (time travel)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from operator import attrgetter

from kvledger.ledger.advice import LatencyRecorder
from kvledger.ledger.collector import collector_paused
from kvledger.ledger.decisions import Release
from kvledger.ledger.events import Event, Map, TransferId
from kvledger.ledger.fold import LedgerState
from kvledger.ledger.limits import REPLAY_COMPACT_EVERY, REPLAY_RETAIN_S
from kvledger.ledger.side import TransferState

try:
    import cython
except ImportError:  # no Cython here: this module runs as Python
    COMPILED = False
else:
    COMPILED = cython.compiled

_ts_of = attrgetter("ts")


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


def cut(chunk: list[Event], until_ts: float | None, until_seq: int | None) -> list[Event]:
    """The events of `chunk` at or before the cut (`--until-ts`, `--until-seq`): one source's clock may step
    back past it, so a replay reads on after the first event left out."""
    return [e for e in chunk if (until_ts is None or e.ts <= until_ts) and (until_seq is None or e.seq <= until_seq)]


def replay_chunks(
    chunks: Iterable[list[Event]],
    *,
    until_seq: int | None = None,
    until_ts: float | None = None,
    on_progress: Callable[[int], None] | None = None,
    compact_every: int | None = REPLAY_COMPACT_EVERY,
    keep_releases: bool = True,
) -> ReplayResult:
    """Fold lists of events into a fresh state, leaving out events after `until_ts` or past
    `until_seq` (per source).

    The state is fresh and private: an error while reading leaves nothing half-applied
    anywhere else. Once at least `compact_every` events have been folded since the last time,
    sides decided whose last event is more than `REPLAY_RETAIN_S` (log time) before the newest
    event are forgotten (their counts kept), so memory follows live transfers, not log length;
    sides with audit evidence are kept. Which sides go is a rule of each side alone (not of the
    order sides were decided in), so a partition of the log folded alone (kvledger.ledger.partitioned),
    compacting after the same chunks with the same cut, forgets exactly its part of what this
    fold forgets. Each list is folded by `_fold_chunk`: no Python step per
    event besides the fold itself.
    """
    result = ReplayResult(LedgerState())
    state = result.state
    compact = state.compact
    latencies = result.latencies
    releases = result.releases
    decided: list[Release] = []
    release_count = 0
    n = 0
    next_compaction = compact_every or 0
    first_ts: float | None = None
    last_ts = float("-inf")
    with collector_paused():
        for chunk in chunks:
            if until_ts is not None or until_seq is not None:
                kept = cut(chunk, until_ts, until_seq)
                if len(kept) < len(chunk):
                    result.stopped_early = True  # not a stop: one source's clock may step back past the cut
                chunk = kept
            if not chunk:
                continue
            newest = _fold_chunk(state, chunk, decided)
            if decided:
                _observe(latencies, decided, state.sides_of)
                release_count += len(decided)
                if keep_releases:
                    releases.extend(decided)
                decided.clear()
            if first_ts is None:
                first_ts = chunk[0].ts
            if newest > last_ts:
                last_ts = newest
            n += len(chunk)
            if compact_every is not None and n >= next_compaction:
                compact(decided_before_ts=last_ts - REPLAY_RETAIN_S, clean_only=True)
                next_compaction = n + compact_every
            if on_progress is not None:
                on_progress(n)
    result.events, result.first_ts, result.last_ts = n, first_ts, (last_ts if n else None)
    result.release_count = release_count
    return result


def _fold_chunk(state: LedgerState, chunk: list[Event], decided: list[Release]) -> float:
    """Fold `chunk` (not empty) into `state`, appending the releases it causes to `decided`; return its
    newest ts. Compiled (ledger/replay.pxd), one C loop that calls the fold's `apply` as a C method and
    reads each ts as a C double; interpreted, `map` and `max` in C rather than a Python step per event."""
    if not COMPILED:
        decided.extend(filter(None, map(state.apply, chunk)))
        newest: float = max(map(_ts_of, chunk))
        return newest
    fold = state
    first = chunk[0]
    newest = first.ts  # as `max` does: the first, replaced only by a greater one
    for event in chunk:
        release = fold.apply(event)
        if release is not None:
            decided.append(release)
        envelope = event
        ts = envelope.ts
        if ts > newest:
            newest = ts
    return newest


def fold_indexed(
    state: LedgerState, chunk: list[Event], decided: list[Release], caused: list[int], claimed: list[int]
) -> None:
    """Fold `chunk` into `state` as `_fold_chunk` does, appending each release to `decided` and the position
    in `chunk` of the event that caused it to `caused`, and the position of each map the fold accepted (its
    side now holds the map's blocks) to `claimed`: what a partition of a log tells the merge
    (kvledger.ledger.partitioned). Compiled, one C loop calling `apply` as a C method."""
    fold = state
    sides_of = state.sides_of
    k = 0
    for event in chunk:
        release = fold.apply(event)
        if release is not None:
            decided.append(release)
            caused.append(k)
        if type(event) is Map:
            side = sides_of[event.source].get(event.transfer_id)
            if side is not None and side.map_event is event:
                claimed.append(k)
        k += 1  # noqa: SIM113 (a C counter compiled; enumerate would box each position)


def _observe(
    latencies: LatencyRecorder, decided: list[Release], sides_of: dict[str, dict[TransferId, TransferState]]
) -> None:
    """Record each release with its side (compiled, `observe` is called as a C method), found by source and
    id in `sides_of`: no key tuple built and hashed per release."""
    for release in decided:
        latencies.observe(release, sides_of[release.source][release.transfer_id])
