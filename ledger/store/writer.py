"""The background writer: appends go on a bounded in-memory queue, a thread writes them in batches.

`put` is an EventLog listener (`log.subscribe(writer.put)`), called under the log's
lock, so it never waits for the store: it appends to a deque or, when the queue is
full (the store slow or down), to a local JSONL spill file. The thread writes
batches (`WRITER_BATCH_EVENTS_MAX` events or `WRITER_BATCH_AGE_S_MAX` old), one
transaction each, retrying with backoff while the store is unavailable.

What is durable is always a gapless prefix of what was put. Spilling starts by writing
everything not yet in the store to a new spill file (the batch in flight, then the
queue) before anything newer, so a spilled event is never durable while an older one
exists only in memory; a kill loses a suffix, never a middle. The writer's thread
starts spilling at the first failed batch, while the queue is short; when the store
hangs instead of failing, the put that finds the queue full does it (writing up to
`WRITER_QUEUE_EVENTS_MAX` events once: the one append of an outage that waits for a
local disk). Every later event goes to that file until the queue is written; then the
file is closed and loaded before the queue (newer events) is touched again. Spill
files left by a killed process are loaded first when a writer starts on the same
directory; the store's idempotent append by (source, seq) makes every load
exactly-once (the in-flight batch copied to the file is a duplicate, skipped).

An event the store refuses for its content (`UnstorableEvent`, `ConflictError`) is
quarantined in the store (or, if even that fails, in `rejected.jsonl` here) and the
rest of its batch goes on: one bad event never stalls the writer.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from kvledger.ledger.events import Event
from kvledger.ledger.jsonl import LogFormatError, LogReader, LogWriter
from kvledger.ledger.store.base import ConflictError, EventStore, StoreError, StoreUnavailable, UnstorableEvent
from kvledger.ledger.store.limits import (
    SPILL_HEADER_PEEK_BYTES,
    SPILL_LOAD_EVENTS_MAX,
    WRITER_BATCH_AGE_S_MAX,
    WRITER_BATCH_EVENTS_MAX,
    WRITER_CLOSE_TIMEOUT_S,
    WRITER_IDLE_POLL_S,
    WRITER_IDLE_WAIT_S,
    WRITER_QUEUE_EVENTS_MAX,
    WRITER_RETRY_BACKOFF_S_MAX,
    WRITER_RETRY_BACKOFF_S_MIN,
)

log = logging.getLogger(__name__)

SPILL_GLOB = "spill-*.jsonl"
REJECTED_FILE = "rejected.jsonl"
"""Where a refused event goes when the store's quarantine cannot take it either."""

T = TypeVar("T")


class _Deadline(Exception):
    """close()'s timeout passed while the store was still failing."""


class BackgroundWriter:
    """Drains events into `store` off the hot path; counts every event's fate in `stats()`."""

    def __init__(
        self,
        store: EventStore,
        spill_dir: str | os.PathLike[str],
        *,
        queue_events_max: int = WRITER_QUEUE_EVENTS_MAX,
        batch_events_max: int = WRITER_BATCH_EVENTS_MAX,
        batch_age_s_max: float | None = None,
    ) -> None:
        """`batch_age_s_max`: default the store's `writer_batch_age_s_max` where it has one (a NATS stream's
        is longer: `NATS_WRITER_BATCH_AGE_S_MAX`), else WRITER_BATCH_AGE_S_MAX."""
        if batch_age_s_max is None:
            batch_age_s_max = float(getattr(store, "writer_batch_age_s_max", WRITER_BATCH_AGE_S_MAX))
        assert queue_events_max >= 1 and batch_events_max >= 1 and batch_age_s_max >= 0
        self.store = store
        self.spill_dir = Path(spill_dir)
        self.spill_dir.mkdir(parents=True, exist_ok=True)
        self.queue_events_max = queue_events_max
        self.batch_events_max = batch_events_max
        self.batch_age_s_max = batch_age_s_max
        self._queue: deque[Event] = deque()
        self._lock = threading.Lock()  # put vs. the writer: the queue, the batch in flight, the spill file
        self._spill: LogWriter | None = None
        self._spill_path: Path | None = None
        # Closed spill files, oldest first; always older than everything in the queue.
        self._pending_files: deque[Path] = deque(sorted(self.spill_dir.glob(SPILL_GLOB)))
        self._file_number = 0
        self._start_ns = time.time_ns()
        self._in_flight: list[Event] = []
        self._first_seen: float | None = None
        """When the oldest queued event not yet in a batch was first seen (monotonic)."""
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self._ready = threading.Event()
        """Set by `put` when a batch begins or fills, and by `close`: what an idle writer waits for (it never
        polls: an engine's writer thread woke every few milliseconds, each time taking the GIL from vLLM's step)."""
        self._stopping = False
        self._stopped = False
        self._deadline = float("inf")
        self._dumped = False
        self._counts = {
            "queued": 0, "spilled": 0, "written": 0, "duplicates": 0, "loaded_from_spill": 0,
            "failed_attempts": 0, "batches": 0, "quarantined": 0, "dropped": 0, "spill_bad_lines": 0,
            "respilled": 0,
        }  # fmt: skip
        # queued + spilled: every event put, each counted once (queued: in `stats` while it waits, here once
        # it has left the queue). respilled: queued (or in-flight) events copied to a spill file when
        # spilling began or at close. quarantined: set aside, never retried (in the store's quarantine
        # table, or in rejected.jsonl).
        self._last_error: str | None = None

    # -- the hot path ------------------------------------------------------

    def put(self, event: Event) -> None:
        """Queue one event; never blocks on the store (a deque append or a buffered file write)."""
        with self._lock:
            if self._spill is None and not self._stopped:
                queue = self._queue
                if len(queue) < self.queue_events_max:
                    queue.append(event)  # counted as queued when it leaves the queue (`_take_locked`)
                    if len(queue) == 1 or len(queue) == self.batch_events_max:
                        self._ready.set()  # a batch begins (its age starts now) or is full: once a batch
                    return
                # The queue is full: the store is slow or down. Spilling starts with everything not yet
                # in the store, oldest first, so that nothing durable ever follows what a kill would lose.
                older = [*self._in_flight, *self._take_locked()]
                self._spill_locked(older, "respilled")
            self._spill_locked((event,), "spilled")

    def _take_locked(self, most: int | None = None) -> list[Event]:
        """The oldest `most` queued events (None: all), taken off the queue and counted as queued: `put` leaves
        the count to here, one addition per batch, as the cheapest put is a bare deque append."""
        if most is None or most >= len(self._queue):
            taken = list(self._queue)
            self._queue.clear()
        else:
            popleft = self._queue.popleft
            taken = [popleft() for _ in range(most)]
        self._counts["queued"] += len(taken)
        return taken

    def _spill_locked(self, events: Iterable[Event], counter: str) -> None:
        batch = list(events)
        try:
            if self._spill is None:
                self._file_number += 1
                self._spill_path = self.spill_dir / f"spill-{self._start_ns:020d}-{self._file_number:06d}.jsonl"
                self._spill = LogWriter(self._spill_path)
            self._spill.write_many(batch)
            self._spill.flush()  # into the OS: survives a kill of this process
            self._counts[counter] += len(batch)
        except OSError as error:
            self._counts["dropped"] += len(batch)
            self._last_error = f"spill to {self.spill_dir} failed: {error}"
            log.error("kvledger writer dropped %d events: %s", len(batch), self._last_error)

    # -- life cycle --------------------------------------------------------

    def start(self) -> BackgroundWriter:
        assert self._thread is None, "writer already started"
        self._thread = threading.Thread(target=self._run, name="kvledger-writer", daemon=True)
        self._thread.start()
        return self

    def close(self, timeout: float = WRITER_CLOSE_TIMEOUT_S) -> bool:
        """Write everything queued and spilled; True when all of it is in the store.

        Past `timeout` (the store still failing) what is left goes to a spill file,
        for the next writer on this directory to load. Later puts are spilled too.
        """
        self._deadline = time.monotonic() + timeout
        self._stopping = True
        self._wake.set()
        self._ready.set()
        if self._thread is not None:
            self._thread.join()
        else:
            self._run()
        with self._lock:
            self._stopped = True  # from now on put spills
            # Puts that raced the thread's exit: newest of all, so they go after any dump.
            late = self._take_locked()
            if late:
                self._spill_locked(late, "respilled")
            if self._spill is not None:
                self._spill.close()
                self._spill = None
            return not late and not self._pending_files and not self._dumped

    def flush(self, timeout: float = WRITER_CLOSE_TIMEOUT_S) -> bool:
        """Wait until everything put so far is in the store (True) or `timeout` passes (False)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                idle = not self._queue and not self._pending_files and not self._in_flight and self._spill is None
            if idle:
                return True
            time.sleep(WRITER_IDLE_POLL_S)
        return False

    def stats(self) -> dict[str, Any]:
        """Counters of every event's fate, plus the current backlog, for metrics."""
        with self._lock:
            out: dict[str, Any] = dict(self._counts)
            out["queued"] += len(self._queue)
            out["queue_depth"] = len(self._queue)
            out["in_flight"] = len(self._in_flight)
            out["spill_files_pending"] = len(self._pending_files) + (self._spill is not None)
            out["spilling"] = self._spill is not None
            out["last_error"] = self._last_error
        return out

    # -- the writer thread -------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                if self._step():
                    return
            except _Deadline:
                self._dump_remaining()
                return
            except Exception as error:  # never let the thread die: what it has not written would wait for ever
                log.exception("kvledger writer: unexpected error; going on")
                with self._lock:
                    self._last_error = f"{type(error).__name__}: {error}"
                if self._stopping and time.monotonic() >= self._deadline:
                    self._dump_remaining()
                    return
                self._wake.wait(WRITER_RETRY_BACKOFF_S_MAX)

    def _step(self) -> bool:
        """One thing to do: load a spill file, write a batch, swap the spill file, or wait. True: done."""
        if self._pending_files:
            self._load_file(self._pending_files[0])
            with self._lock:
                self._pending_files.popleft()
            return False
        queued = len(self._queue)
        if queued:
            now = time.monotonic()
            first_seen = self._first_seen = now if self._first_seen is None else self._first_seen
            if self._stopping or queued >= self.batch_events_max or now - first_seen >= self.batch_age_s_max:
                with self._lock:  # a put that starts spilling copies this batch: it must see all of it
                    self._in_flight = self._take_locked(self.batch_events_max)
                self._write(self._in_flight)
                with self._lock:
                    self._in_flight = []
                self._first_seen = None if not self._queue else time.monotonic()
                return False
            wait_s = first_seen + self.batch_age_s_max - now  # until the batch is due, unless it fills first
        elif self._spill is not None:
            self._swap_spill()
            return False
        elif self._stopping:
            return True
        else:
            wait_s = WRITER_IDLE_WAIT_S
        self._ready.wait(wait_s)
        self._ready.clear()  # before the next look at the queue: a put after it sets it again
        return False

    def _swap_spill(self) -> None:
        """The queue is written: close the spill file and make it the next thing to load."""
        with self._lock:
            if self._queue or self._spill is None:
                return
            assert self._spill_path is not None
            self._spill.close()
            self._pending_files.append(self._spill_path)
            self._spill = None

    def _retrying(
        self,
        call: Callable[[], T],
        retry_on: type[Exception] | tuple[type[Exception], ...],
        on_failure: Callable[[], None] | None = None,
    ) -> T:
        """`call()`, again with backoff while it raises `retry_on`, until it succeeds or close()'s deadline."""
        backoff = WRITER_RETRY_BACKOFF_S_MIN
        while True:
            try:
                return call()
            except (ConflictError, UnstorableEvent):
                raise  # about the events, not the store: retrying cannot help
            except retry_on as error:
                with self._lock:
                    self._counts["failed_attempts"] += 1
                    self._last_error = str(error)
                if on_failure is not None:
                    on_failure()
                log.warning("kvledger writer: store call failed (%s); retrying", error)
                if self._stopping and time.monotonic() + backoff > self._deadline:
                    raise _Deadline from error
                self._wake.wait(backoff)
                backoff = min(backoff * 2, WRITER_RETRY_BACKOFF_S_MAX)

    def _write(self, batch: Sequence[Event], *, from_spill: bool = False) -> None:
        """Append `batch`, one transaction at a time, retrying while the store is unavailable (any failure
        that is not about an event is taken as the store's: a generic error retries too, and the events
        wait in the queue or the spill). Events refused for their content are quarantined; the rest land."""
        rest = list(batch)
        while rest:
            try:
                inserted = self._retrying(
                    lambda: self.store.append(rest),  # noqa: B023
                    Exception,
                    None if from_spill else self._start_spilling,
                )
            except (ConflictError, UnstorableEvent) as error:
                index = error.index if isinstance(error, UnstorableEvent) else None
                if len(rest) == 1:
                    self._quarantine(rest[0], error)
                    return
                if index is None:
                    # Which one is unknown (a conflict, or the database's own refusal): one at a time.
                    for event in rest:
                        self._write([event], from_spill=from_spill)
                    return
                if index:
                    self._write(rest[:index], from_spill=from_spill)
                self._quarantine(rest[index], error)
                rest = rest[index + 1 :]
                continue
            with self._lock:
                self._counts["written"] += inserted
                self._counts["duplicates"] += len(rest) - inserted
                self._counts["batches"] += 1
                if from_spill:
                    self._counts["loaded_from_spill"] += len(rest)
            return

    def _start_spilling(self) -> None:
        """The store failed a batch from the queue: spill from now on, starting here, off the hot path, while
        the queue is still short (the put that would otherwise start it, on a full queue, writes all of it)."""
        with self._lock:
            if self._spill is None and not self._stopped:
                older = [*self._in_flight, *self._take_locked()]
                self._spill_locked(older, "respilled")

    def _quarantine(self, event: Event, error: StoreError) -> None:
        """Set aside an event the store refused: in its quarantine table, else in rejected.jsonl; never retried."""
        reason = f"{type(error).__name__}: {error}"
        where = f"{self.store.url} quarantine"
        kept = 1
        failed: list[bool] = []  # an attempt failed: its insert may have committed with the answer lost
        try:
            kept = self._retrying(
                lambda: self.store.quarantine([(event, reason)]), StoreUnavailable, lambda: failed.append(True)
            )
        except _Deadline:
            raise  # the event stays with the batch in flight or its spill file, for the next writer
        except Exception as failure:  # a store without the table, or one that refuses this too
            where = str(self.spill_dir / REJECTED_FILE)
            try:
                with LogWriter(self.spill_dir / REJECTED_FILE) as rejected:
                    rejected.write(event)
            except (OSError, ValueError) as io_error:
                where = f"nowhere ({failure}; {io_error})"
        if not kept and not failed:
            return  # already there: a spilled copy of a batch that was in flight when it was refused
        log.error("kvledger writer: %s; set aside in %s", reason, where)
        with self._lock:
            self._counts["quarantined"] += 1
            self._last_error = reason

    def _load_file(self, path: Path) -> None:
        with open(path, "rb") as stream:
            head = stream.read(SPILL_HEADER_PEEK_BYTES)
            stream.seek(0)
            if b"\n" not in head:
                # Killed between creating the file and flushing its header: it holds no event.
                log.warning("kvledger writer: spill file %s has no complete header line; removed", path)
                with self._lock:
                    self._counts["spill_bad_lines"] += 1 if head else 0
                path.unlink()
                return
            # Not checked against `kvledger.ledger.valid` here: the store checks, and quarantines what fails.
            try:
                reader = LogReader(stream, str(path), skip_bad_lines=True, check=False)
            except LogFormatError as error:
                aside = path.with_suffix(".unreadable")
                log.error("kvledger writer: %s; the file is set aside as %s", error, aside)
                with self._lock:
                    self._counts["spill_bad_lines"] += 1
                    self._last_error = str(error)
                path.rename(aside)
                return
            chunk: list[Event] = []
            for event in reader:
                chunk.append(event)
                if len(chunk) >= SPILL_LOAD_EVENTS_MAX:
                    self._write(chunk, from_spill=True)
                    chunk = []
            if chunk:
                self._write(chunk, from_spill=True)
            with self._lock:
                self._counts["spill_bad_lines"] += len(reader.skipped)
        path.unlink()

    def _dump_remaining(self) -> None:
        """The deadline passed: put the batch in flight and the queue on disk for the next writer."""
        with self._lock:
            self._dumped = True
            taken = self._take_locked()
            if self._spill is None:
                older = [*self._in_flight, *taken]
                if older:
                    self._spill_locked(older, "respilled")
            # else: the open spill file began with the batch in flight and the queue (see `put`), and
            # every later event went to it: it already holds all of them, in order.
            self._in_flight = []
