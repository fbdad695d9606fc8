"""Reopen a source's ledger from a store: latest snapshot plus a refold of the tail, seq continuing.

Spill files a killed writer left behind are loaded first, every durable event of them exactly
once and in order: their events are part of the log, and the next seq must come after them.
A hole in a source's seqs (an event quarantined as unstorable, or lost in a failed spill write)
does not stop recovery: it is folded over and reported in `Recovered.gaps`, and no seq of a
quarantined event is ever given out again.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

from kvledger.ledger.fold import LedgerState
from kvledger.ledger.ledger import Ledger
from kvledger.ledger.limits import MAINTENANCE_INTERVAL_S
from kvledger.ledger.store import snapshot
from kvledger.ledger.store.base import EventStore, StoredSnapshot, StoreUnavailable
from kvledger.ledger.store.limits import SNAPSHOT_TAIL_EVENTS_MAX, WRITER_CLOSE_TIMEOUT_S
from kvledger.ledger.store.writer import BackgroundWriter

log = logging.getLogger(__name__)


class Recovered:
    """The folded state of one source and how it was obtained."""

    def __init__(
        self, state: LedgerState, last_seq: int, snapshot_seq: int, folded: int, gaps: list[tuple[int, int]]
    ) -> None:
        self.state = state
        self.last_seq = last_seq
        self.snapshot_seq = snapshot_seq
        self.folded = folded
        self.gaps = gaps
        """(first, last) seq ranges missing from the stored log after the snapshot, in order."""


def load_state(
    store: EventStore,
    source: str,
    *,
    use_snapshot: bool = True,
    retain_s: float | None = None,
    tombstones_max: int | None = None,
) -> Recovered:
    """Fold `source`'s stored events (after its latest readable snapshot); seqs missing on the way are
    reported in `gaps`, not fatal (the fold takes events in any order; what is missing is evidence).

    With `retain_s`, decided sides are forgotten as the refold goes, as the running ledger forgot them
    (`Ledger.maintain`: those decided `retain_s` before, every `MAINTENANCE_INTERVAL_S` of log time), so a
    restart holds what the running ledger held, not the whole history. `tombstones_max` is the state's
    tombstone bound from the first event on (default: the snapshot's, else `TOMBSTONES_MAX`)."""
    state, start = LedgerState(), 0
    stored = store.latest_snapshot(source) if use_snapshot else None
    if stored is not None:
        try:
            state, start = snapshot.decode(stored.body), stored.seq
        except snapshot.SnapshotFormatError:
            state, start = LedgerState(), 0  # an old format: the events are the truth, refold them all
    if tombstones_max is not None:
        state.tombstones_max = tombstones_max
    expected = start + 1
    folded = 0
    gaps: list[tuple[int, int]] = []
    apply, forget = state.apply, state.forget_decided
    next_maintenance = float("-inf")
    for event in store.read(source=source, after_seq=start):
        seq = event.seq
        if seq >= expected:
            if seq > expected:
                gaps.append((expected, seq - 1))
            expected = seq + 1
        else:
            _filled(gaps, seq)  # stored after a later one (a remote appender filling a gap)
        apply(event)
        folded += 1
        if retain_s is not None and event.ts >= next_maintenance:
            forget(event.ts - retain_s)
            next_maintenance = event.ts + MAINTENANCE_INTERVAL_S
    return Recovered(state, expected - 1, start, folded, gaps)


def _filled(gaps: list[tuple[int, int]], seq: int) -> None:
    for i, (first, last) in enumerate(gaps):
        if first <= seq <= last:
            gaps[i : i + 1] = [r for r in ((first, seq - 1), (seq + 1, last)) if r[0] <= r[1]]
            return


def save_snapshot(store: EventStore, source: str, state: LedgerState, seq: int) -> StoredSnapshot:
    """Store `state` as `source`'s folded state after its event `seq` (that event must be stored)."""
    stored = StoredSnapshot(source, seq, snapshot.FORMAT, time.time(), snapshot.encode(state))
    store.save_snapshot(stored)
    return stored


def snapshot_source(store: EventStore, source: str) -> StoredSnapshot:
    """Fold what the store holds for `source` and snapshot it (safe while appends go on)."""
    recovered = load_state(store, source)
    return save_snapshot(store, source, recovered.state, recovered.last_seq)


def drain_spill(store: EventStore, spill_dir: str | os.PathLike[str], timeout: float = WRITER_CLOSE_TIMEOUT_S) -> None:
    """Load every spill file left in `spill_dir` into the store; refuse to go on if it cannot (the
    next seq would reuse theirs)."""
    if not BackgroundWriter(store, spill_dir).close(timeout):
        raise StoreUnavailable(
            f"{store.url}: could not load the spill files in {spill_dir}; recovering now would reuse their seqs"
        )


def quarantined_max_seq(store: EventStore, source: str) -> int:
    """The highest seq of `source` the store quarantined (0 if none): never to be given out again."""
    return max((q.seq for q in store.quarantined(source=source) if q.seq is not None), default=0)


def open_ledger(
    store: EventStore,
    source: str,
    *,
    spill_dir: str | os.PathLike[str] | None = None,
    clock: Callable[[], float] = time.time,
    snapshot_tail_events_max: int = SNAPSHOT_TAIL_EVENTS_MAX,
    retain_s: float | None = None,
    tombstones_max: int | None = None,
) -> Ledger:
    """A Ledger for `source` continuing the stored log: same state, next seq after the last stored one
    (with `retain_s` and `tombstones_max`, forgotten and bounded as the running ledger was: `load_state`).

    When the refold after the latest snapshot was longer than `snapshot_tail_events_max`
    events, a new snapshot is written so that the next restart is short. Gaps in the stored
    log are logged as errors (see `load_state`).
    """
    if spill_dir is not None:
        drain_spill(store, spill_dir)
    recovered = load_state(store, source, retain_s=retain_s, tombstones_max=tombstones_max)
    if recovered.gaps:
        shown = ", ".join(f"{first}..{last}" for first, last in recovered.gaps[:10])
        log.error(
            "kvledger: %s's stored log misses seqs %s%s (quarantined as unstorable, or lost with a failed spill "
            "write: see the store's quarantine and the writer's log); folded without them",
            source, shown, " and more" if len(recovered.gaps) > 10 else "",
        )  # fmt: skip
    next_seq = max(recovered.last_seq, quarantined_max_seq(store, source)) + 1
    if recovered.folded > snapshot_tail_events_max:
        save_snapshot(store, source, recovered.state, recovered.last_seq)
    return Ledger(source, clock=clock, state=recovered.state, next_seq=next_seq)
