"""The append-only in-memory event log of one source: gapless seqs, thread-safe appends."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator

import msgspec

from kvledger.ledger.events import UNASSIGNED_SEQ, Event

Listener = Callable[[Event], None]


class SeqError(ValueError):
    """An event arrived with a seq that is not the log's next one."""


def number(batch: list[Event], seq: int, source: str) -> int:
    """Number `batch` in place from `seq` on (an unassigned seq gets a copy of its event with the next one);
    returns the seq after the last. Raises, the list half numbered and nothing else changed, at the first
    event of another source or with a seq that is neither unassigned nor the next one. Compiled with the
    fold (log.pxd): the per-event reads are C struct reads, and the seqs 64-bit C integers (every seq fits
    one: ledger/limits.py), where a Python int was compared and another made for each event."""
    for i in range(len(batch)):
        envelope = batch[i]
        try:
            found = envelope.seq
        except (OverflowError, TypeError):  # compiled only: no 64-bit integer (kvledger.ledger.valid refuses such seqs)
            raise SeqError(f"event seq {envelope.seq!r} but the log expects {seq}") from None
        if found != seq:
            if found != UNASSIGNED_SEQ:
                raise SeqError(f"event seq {found} but the log expects {seq}")
            batch[i] = envelope = msgspec.structs.replace(envelope, seq=seq)
        if envelope.source != source:
            raise ValueError(f"event source {envelope.source!r} in the log of {source!r}")
        seq += 1
    return seq


class EventLog:
    """Events of one `source`, numbered 1, 2, 3, ... in append order.

    Appends come from several threads (vLLM's scheduler thread, transport and
    notification threads); each append takes the lock, assigns the seq and calls
    the listeners in seq order before the next append can start, so a projection
    sees exactly the log's order. Listeners must be quick and must not append.
    `retain_from(seq)` lets go of older events once they are persisted; seqs stay
    gapless.
    """

    def __init__(self, source: str, *, next_seq: int = 1) -> None:
        if not source:
            raise ValueError("source must be a non-empty string such as 'prefill-0/tp0'")
        if next_seq < 1:
            raise ValueError(f"next_seq must be >= 1, got {next_seq}")
        self.source = source
        self._events: list[Event] = []
        self._first_seq = next_seq
        self._next_seq = next_seq
        self._listeners: list[Listener] = []
        self.lock = threading.Lock()

    @property
    def next_seq(self) -> int:
        return self._next_seq

    @property
    def first_seq(self) -> int:
        """The seq of the oldest event still held in memory."""
        return self._first_seq

    def __len__(self) -> int:
        return len(self._events)

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call `listener(event)` for every event appended from now on; returns an unsubscribe."""
        with self.lock:
            self._listeners.append(listener)

        def unsubscribe() -> None:
            with self.lock:
                if listener in self._listeners:
                    self._listeners.remove(listener)

        return unsubscribe

    def append(self, event: Event) -> Event:
        """Append one event; an unassigned seq (0) gets the next one, any other must equal it."""
        with self.lock:
            return self.append_held(event)

    def extend(self, events: Iterable[Event]) -> list[Event]:
        """Append several events under one lock acquisition; all or nothing on a seq error."""
        batch = list(events)
        with self.lock:
            return self.extend_held(batch)

    # The `_held` variants are for an owner that holds `lock` already (the ledger folds each event under
    # the same acquisition: one lock per append instead of two).

    def extend_held(self, batch: list[Event]) -> list[Event]:
        """`extend` of a list the caller gives up (numbered in place), `lock` held by the caller."""
        seq = number(batch, self._next_seq, self.source)
        self._events.extend(batch)
        self._next_seq = seq
        for listener in self._listeners:
            for event in batch:
                listener(event)
        return batch

    def append_held(self, event: Event) -> Event:
        """`append`, `lock` held by the caller."""
        seq = self._next_seq
        if event.seq != seq:
            if event.seq != UNASSIGNED_SEQ:
                raise SeqError(f"event seq {event.seq} but the log expects {seq}")
            event = msgspec.structs.replace(event, seq=seq)
        if event.source != self.source:
            raise ValueError(f"event source {event.source!r} in the log of {self.source!r}")
        self._events.append(event)
        self._next_seq = seq + 1
        for listener in self._listeners:
            listener(event)
        return event

    def since(self, seq: int = 0) -> Iterator[Event]:
        """Events with a seq greater than `seq` still held in memory, in order."""
        with self.lock:
            start = max(0, seq + 1 - self._first_seq)
            snapshot = self._events[start:]
        return iter(snapshot)

    def retain_from(self, seq: int) -> int:
        """Drop events with a seq below `seq` from memory; returns how many were dropped."""
        with self.lock:
            return self.retain_from_held(seq)

    def retain_from_held(self, seq: int) -> int:
        """`retain_from`, `lock` held by the caller."""
        drop = max(0, min(seq, self._next_seq) - self._first_seq)
        del self._events[:drop]
        self._first_seq += drop
        return drop
