"""Where a partition worker's events come from (`kvledger.ledger.fleet.run_worker`): the contract its loop
folds from, and the source for SQL stores (SQLite, PostgreSQL), which reads the store's tail by cursor.

Two sources satisfy `PartitionSource`:

- a NATS stream: `kvledger.ledger.store.nats_consumer.PartitionConsumers`, one durable consumer per
  partition, each message one stored batch of one partition; positions are stream sequences, an event's
  cursor `stream seq << 16 | place` (`cursor_shift` 16); what a saved fold holds is acknowledged;
- a SQL store: `StoreTail`, the store's tail in cursor order (`EventStore.tail`) from the least position
  the worker's folds hold, each event kept for its partition (`kvledger.ledger.partition.partition_of_event`)
  when the worker owns that partition and its fold does not hold it yet. Positions are store cursors
  (`cursor_shift` 0). Nothing is acknowledged: the position is in the saved fold. A store has no
  partition count of its own: `SQL_PARTITIONS`.

The SQL tail has no partition column to filter on (it would be a schema change): every worker reads and
decodes every row and keeps its own partitions' events, so W workers read the store W times.

A saved fold's position in a SQL store is checked before it is believed, as the one-process service checks
its snapshots (`kvledger.api.snapshots`): the store's id, how many rows the store holds at cursors up to
the position, and which event is at it (`Mark`). A fold whose mark the store does not hold (a snapshot
copied from another store, rows removed, or SQLite's rowids taken again after the newest rows went) is
folded again from the store's start (`reset`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import NamedTuple, Protocol

import msgspec

from kvledger.ledger.events import Event
from kvledger.ledger.partition import partition_of_event
from kvledger.ledger.store.base import EventStore
from kvledger.ledger.store.limits import TAIL_EVENTS_MAX

log = logging.getLogger(__name__)

SQL_PARTITIONS = 16
"""Partitions of a SQL store's transfers (the NATS stream's default count): `--partitions` names them, and
the saved folds are named by them, so any number of workers (up to this) goes on from the same snapshots."""
SQL_FETCH_ROWS = TAIL_EVENTS_MAX
"""Rows one fetch of a SQL store's tail reads (every partition's, each worker)."""


class Mark(msgspec.Struct, frozen=True, array_like=True):
    """What a SQL store held up to a position: its id, its rows at cursors up to it, and the (source, seq) of
    the event at it (None: position 0)."""

    store_id: str
    rows: int
    last: tuple[str, int] | None


class Delivered(NamedTuple):
    """What one fetch brought of one partition."""

    partition: int
    rows: list[tuple[int, Event]]
    """The events not handed over before, with their cursors, in store order."""
    last_seq: int
    """The position (stream sequence, or SQL cursor) of the last event handed over in `rows` (0: none)."""
    upto: int
    """Every event of the partition at or below this position has been handed over (or folded before this
    source started)."""
    redelivered: int
    """Messages passed over: delivered again, already handed over or folded."""
    mark: Mark | None = None
    """A SQL store's `Mark` at `upto` (None from a NATS stream)."""


class Held(NamedTuple):
    """Where a restored fold is: every event of its partition at or below `upto` folded; `mark` as it saved it."""

    upto: int
    mark: Mark | None


class PartitionSource(Protocol):
    """What `run_worker` folds from (see the module docstring)."""

    cursor_shift: int
    """An event's cursor is `position << cursor_shift | place`."""
    reset: list[int]
    """Partitions whose restored fold the source could not go on from: the worker folds them from the start."""
    behind: bool
    """The last fetch stopped at its limit with more waiting (a backlog: a start over a large store)."""

    def fetch(self, messages: int | None, timeout: float) -> list[Delivered]:
        """The owned partitions' next events (up to `messages` messages or rows, None: the source's default),
        waiting up to `timeout` seconds where none is there; one `Delivered` per partition, in partition order."""
        ...

    def ack(self, partition: int, through: int) -> None:
        """A saved fold holds `partition`'s events up to position `through`."""
        ...

    def close(self) -> None: ...


class StoreTail:
    """A SQL store's tail, read for the partitions one worker owns (see the module docstring)."""

    cursor_shift = 0
    behind = False

    def __init__(
        self, store: EventStore, partitions: int, owned: Sequence[int], held: Mapping[int, Held] | None = None
    ) -> None:
        """`held`: per partition, where its restored fold is; a position the store does not hold as marked is
        dropped (`reset`)."""
        self.store = store
        self.partitions = partitions
        self.owned = sorted(set(owned))
        if not self.owned or any(not 0 <= p < partitions for p in self.owned):
            raise ValueError(f"partitions {list(owned)} are not within range({partitions})")
        self.store_id = store.store_id()
        self.reset: list[int] = []
        self.folded: dict[int, int] = {}
        """Per partition, the position its fold holds (events at or below it are passed over)."""
        checked: dict[int, str | None] = {}
        for p in self.owned:
            h = (held or {}).get(p, Held(0, None))
            if h.upto and h.upto not in checked:
                checked[h.upto] = self._problem(h)
            why = checked.get(h.upto) if h.upto else None
            if why is not None:
                log.warning("kvledger worker: partition %d's saved fold at cursor %d is not used: %s; folding the "
                            "partition from the store's start", p, h.upto, why)  # fmt: skip
                self.reset.append(p)
                h = Held(0, None)
            self.folded[p] = h.upto
        start = min(self.folded.values())
        mark = next((h.mark for p, h in (held or {}).items() if p not in self.reset and h.upto == start), None)
        self.position = start
        """Every row at or below this cursor has been read."""
        self.rows = mark.rows if mark is not None and start else 0
        """The store's rows at cursors up to `position`."""
        self.last: tuple[str, int] | None = mark.last if mark is not None and start else None

    def _problem(self, held: Held) -> str | None:
        """Why the store does not hold what a fold saved at `held.upto`, or None."""
        mark = held.mark
        if mark is None:
            return "it names no mark of the store"
        if mark.store_id != self.store_id:
            return f"it was taken of another store ({mark.store_id!r}; this one is {self.store_id!r})"
        rows = self.store.count_through(held.upto)
        if rows != mark.rows:
            return f"the store holds {rows} rows at cursors up to it, the fold read {mark.rows}"
        found = self.store.tail(held.upto - 1, 1)
        at = (found[0][1].source, found[0][1].seq) if found and found[0][0] == held.upto else None
        if at != mark.last:
            return f"the store's event there is {at}, the fold's last read was {mark.last}"
        return None

    def fetch(self, messages: int | None, timeout: float) -> list[Delivered]:
        limit = min(messages or SQL_FETCH_ROWS, TAIL_EVENTS_MAX)
        rows = self.store.tail(self.position, limit)
        self.behind = len(rows) == limit
        if not rows:
            time.sleep(timeout)
            mark = Mark(self.store_id, self.rows, self.last)
            return [Delivered(p, [], 0, self.position, 0, mark) for p in self.owned]
        mine: dict[int, list[tuple[int, Event]]] = {p: [] for p in self.owned}
        folded, partitions = self.folded, self.partitions
        passed = dict.fromkeys(self.owned, 0)
        for cursor, event in rows:
            p = partition_of_event(event, partitions)
            kept = mine.get(p)
            if kept is not None:
                if cursor > folded[p]:
                    kept.append((cursor, event))
                else:
                    passed[p] += 1
        last_cursor, last_event = rows[-1]
        self.position = last_cursor
        self.rows += len(rows)
        self.last = (last_event.source, last_event.seq)
        mark = Mark(self.store_id, self.rows, self.last)
        out = []
        for p in self.owned:
            got = mine[p]
            if got:
                folded[p] = got[-1][0]
            out.append(Delivered(p, got, got[-1][0] if got else 0, last_cursor, passed[p], mark))
        return out

    def ack(self, partition: int, through: int) -> None:
        """Nothing to do: the position is in the saved fold."""

    def close(self) -> None:
        """Nothing to do: the store is the caller's."""
