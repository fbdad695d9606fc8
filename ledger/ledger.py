"""A source's ledger: its event log with the fold attached, and the releases it derives.

The thin shell the connector talks to: `append` assigns the seq, folds the event
under the same lock (so the state always equals a fold of the log) and queues the
release it caused for `take_releases`. The clock is read here, never in the fold.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from kvledger.ledger.decisions import Release
from kvledger.ledger.events import Event, Expire
from kvledger.ledger.fold import LedgerState, apply_all
from kvledger.ledger.limits import LOG_EVENTS_RETAINED_MAX, MAINTENANCE_INTERVAL_S
from kvledger.ledger.log import EventLog


class Ledger:
    def __init__(
        self,
        source: str,
        *,
        clock: Callable[[], float] = time.time,
        state: LedgerState | None = None,
        next_seq: int = 1,
    ) -> None:
        self.log = EventLog(source, next_seq=next_seq)
        self.state = state if state is not None else LedgerState()
        self.clock = clock
        self._lock = self.log.lock
        """The log's own lock: an append numbers, stores and folds its event under one acquisition (the
        log's `_held` methods), so the state always equals a fold of the log and a listener sees each
        event before the next one is folded."""
        self._outbox: deque[Release] = deque()
        self._closers: list[Callable[[], object]] = []
        self._next_maintenance = float("-inf")

    @property
    def source(self) -> str:
        return self.log.source

    def record(self, event_type: type[Any], **fields: Any) -> tuple[Event, Release | None]:
        """Build an event of `event_type` stamped with this source and the clock, and append it."""
        fields.setdefault("ts", self.clock())
        event: Event = event_type(source=self.log.source, **fields)
        with self._lock:
            stored = self.log.append_held(event)
            release = self.state.apply(stored)
            if release is not None:
                self._outbox.append(release)
        return stored, release

    def append(self, event: Event) -> Release | None:
        """Append a built event (its seq 0 or the next one) and fold it."""
        with self._lock:
            release = self.state.apply(self.log.append_held(event))
            if release is not None:
                self._outbox.append(release)
        return release

    def extend(self, events: Iterable[Event]) -> list[Release]:
        """Append and fold a batch under one lock; returns the releases it caused."""
        batch = list(events)  # numbered in place: the caller's own list stays as given
        with self._lock:
            out: list[Release] = []
            apply_all(self.state, self.log.extend_held(batch), out)
            self._outbox.extend(out)
        return out

    def expire_due(self, now: float, *, transfer_timeout_s: float) -> list[Release]:
        """The clock tick: append an `expire` for every deadline passed at `now` (a producer's is its
        defer deadline, a consumer's its transfer deadline) and for every never-mapped side older
        than `transfer_timeout_s`. Returns the releases they caused."""
        state, source = self.state, self.log.source
        expired: list[Event] = [
            Expire(ts=now, source=source, transfer_id=t.transfer_id,
                   deadline="defer" if t.role == "producer" else "transfer")
            for t in state.due(now)
        ]  # fmt: skip
        if state.unmapped:
            expired.extend(
                Expire(ts=now, source=source, transfer_id=t.transfer_id, deadline="transfer")
                for t in state.orphans_due(now, transfer_timeout_s)
            )
        return self.extend(expired) if expired else []

    def maintain(self, now: float, *, retain_s: float) -> int:
        """Keep memory bounded by live transfers in a long-running process (rate-limited; cheap to call
        every step): forget sides decided more than `retain_s` ago and let go of the oldest in-memory
        events beyond `LOG_EVENTS_RETAINED_MAX` (a persistence writer holds its own references until
        they are written). Returns how many sides were forgotten."""
        if now < self._next_maintenance:
            return 0
        self._next_maintenance = now + MAINTENANCE_INTERVAL_S
        with self._lock:
            dropped = self.state.forget_decided(now - retain_s)
            excess = len(self.log) - LOG_EVENTS_RETAINED_MAX
            if excess > 0:
                self.log.retain_from_held(self.log.first_seq + excess)
        return dropped

    def on_close(self, closer: Callable[[], object]) -> None:
        """Run `closer` at `close()` (a persistence writer's flush, for example), last added first."""
        self._closers.append(closer)

    def close(self) -> None:
        """Flush and close what is attached (persistence); the in-memory log stays readable."""
        while self._closers:
            self._closers.pop()()

    def take_releases(self) -> list[Release]:
        """Releases decided since the last call, in decision order (each returned once)."""
        out: list[Release] = []
        outbox = self._outbox
        while outbox:
            out.append(outbox.popleft())
        return out
