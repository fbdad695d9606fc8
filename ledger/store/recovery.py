"""Reopen a source's ledger from a store: latest snapshot plus a refold of the tail, seq continuing.

Spill files a crashed writer left behind are loaded first: their events are part of
the log, and the next seq must come after them.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from ledger.events import Event
from ledger.fold import LedgerState
from ledger.jsonl import LogReader, LogWriter, write_log
from ledger.ledger import Ledger
from ledger.store import snapshot
from ledger.store.base import EventStore, StoredSnapshot, StoreError, StoreUnavailable
from ledger.store.limits import SNAPSHOT_TAIL_EVENTS_MAX, SPILL_HEADER_PEEK_BYTES, WRITER_CLOSE_TIMEOUT_S
from ledger.store.writer import SPILL_GLOB, BackgroundWriter

log = logging.getLogger(__name__)


class Recovered:
    """The folded state of one source and how it was obtained."""

    def __init__(self, state: LedgerState, last_seq: int, snapshot_seq: int, folded: int) -> None:
        self.state = state
        self.last_seq = last_seq
        self.snapshot_seq = snapshot_seq
        self.folded = folded


def load_state(store: EventStore, source: str, *, use_snapshot: bool = True) -> Recovered:
    """Fold `source`'s stored events (after its latest readable snapshot); checks the seqs are gapless."""
    state, start = LedgerState(), 0
    stored = store.latest_snapshot(source) if use_snapshot else None
    if stored is not None:
        try:
            state, start = snapshot.decode(stored.body), stored.seq
        except snapshot.SnapshotFormatError:
            state, start = LedgerState(), 0  # an old format: the events are the truth, refold them all
    expected = start + 1
    apply = state.apply
    for event in store.read(source=source, after_seq=start):
        if event.seq != expected:
            raise StoreError(f"{store.url}: {source!r} jumps from seq {expected - 1} to {event.seq}: the log has a gap")
        apply(event)
        expected += 1
    return Recovered(state, expected - 1, start, expected - 1 - start)


def save_snapshot(store: EventStore, source: str, state: LedgerState, seq: int) -> StoredSnapshot:
    """Store `state` as `source`'s folded state after its event `seq` (that event must be stored)."""
    stored = StoredSnapshot(source, seq, snapshot.FORMAT, time.time(), snapshot.encode(state))
    store.save_snapshot(stored)
    return stored


def snapshot_source(store: EventStore, source: str) -> StoredSnapshot:
    """Fold what the store holds for `source` and snapshot it (safe while appends go on)."""
    recovered = load_state(store, source)
    return save_snapshot(store, source, recovered.state, recovered.last_seq)


def quarantine_gaps(store: EventStore, spill_dir: str | os.PathLike[str]) -> int:
    """Move spilled events that cannot follow the stored log into `orphaned-*.jsonl`; returns how many.

    A writer spills only when its queue is full, and loads a spill file only after the
    queue before it is written. A crash in between loses the queued events (they were
    never durable) while the spill file after them survives: loading it would leave a
    hole in the log. Those events stay on disk, set aside and reported, and the log
    continues from its stored, gapless prefix.
    """
    folder = Path(spill_dir)
    files = sorted(folder.glob(SPILL_GLOB)) if folder.is_dir() else []
    if not files:
        return 0
    expected = {source: last + 1 for source, last in store.sources().items()}
    broken: set[str] = set()
    orphaned = 0
    orphan_writer: LogWriter | None = None
    for path in files:
        kept: list[Event] = []
        with open(path, "rb") as stream:
            if b"\n" not in stream.read(SPILL_HEADER_PEEK_BYTES):
                continue  # an empty file from a kill: the writer removes it
            stream.seek(0)
            for event in LogReader(stream, str(path), skip_bad_lines=True):
                next_seq = expected.get(event.source, 1)
                if event.source not in broken and event.seq <= next_seq:
                    kept.append(event)
                    expected[event.source] = max(next_seq, event.seq + 1)
                    continue
                broken.add(event.source)
                if orphan_writer is None:
                    orphan_writer = LogWriter(folder / f"orphaned-{time.time_ns():020d}.jsonl")
                orphan_writer.write(event)
                orphaned += 1
        if orphaned:
            write_log(path, kept)
    if orphan_writer is not None:
        orphan_writer.close()
        log.error(
            "kvledger: %d spilled events of %s follow events lost in a crash; set aside in %s",
            orphaned, sorted(broken), folder,
        )  # fmt: skip
    return orphaned


def drain_spill(store: EventStore, spill_dir: str | os.PathLike[str], timeout: float = WRITER_CLOSE_TIMEOUT_S) -> None:
    """Load every spill file left in `spill_dir` into the store (events that would leave a hole are
    set aside first, see `quarantine_gaps`); refuse to go on if it cannot."""
    quarantine_gaps(store, spill_dir)
    if not BackgroundWriter(store, spill_dir).close(timeout):
        raise StoreUnavailable(
            f"{store.url}: could not load the spill files in {spill_dir}; recovering now would reuse their seqs"
        )


def open_ledger(
    store: EventStore,
    source: str,
    *,
    spill_dir: str | os.PathLike[str] | None = None,
    clock: Callable[[], float] = time.time,
    snapshot_tail_events_max: int = SNAPSHOT_TAIL_EVENTS_MAX,
) -> Ledger:
    """A Ledger for `source` continuing the stored log: same state, next seq after the last stored one.

    When the refold after the latest snapshot was longer than `snapshot_tail_events_max`
    events, a new snapshot is written so that the next restart is short.
    """
    if spill_dir is not None:
        drain_spill(store, spill_dir)
    recovered = load_state(store, source)
    if recovered.folded > snapshot_tail_events_max:
        save_snapshot(store, source, recovered.state, recovered.last_seq)
    return Ledger(source, clock=clock, state=recovered.state, next_seq=recovered.last_seq + 1)
