"""The background writer: appends go on a bounded in-memory queue, a thread writes them in batches.

`put` is an EventLog listener (`log.subscribe(writer.put)`), called under the log's
lock, so it never waits for the store: it appends to a deque or, when the queue is
full (the store slow or down), to a local JSONL spill file. The thread writes
batches (`WRITER_BATCH_EVENTS_MAX` events or `WRITER_BATCH_AGE_S_MAX` old), one
transaction each, retrying with backoff while the store is down.

Order is kept exactly: once spilling starts every later event goes to the file
until the queue (older events) is written; then the file is closed and loaded
before the queue (newer events) is touched again. Spill files left by a crashed
process are loaded first when a writer starts on the same directory; the store's
idempotent append by (source, seq) makes every load exactly-once.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from ledger.events import Event
from ledger.jsonl import LogReader, LogWriter
from ledger.store.base import ConflictError, EventStore
from ledger.store.limits import (
    SPILL_HEADER_PEEK_BYTES,
    SPILL_LOAD_EVENTS_MAX,
    WRITER_BATCH_AGE_S_MAX,
    WRITER_BATCH_EVENTS_MAX,
    WRITER_CLOSE_TIMEOUT_S,
    WRITER_IDLE_POLL_S,
    WRITER_QUEUE_EVENTS_MAX,
    WRITER_RETRY_BACKOFF_S_MAX,
    WRITER_RETRY_BACKOFF_S_MIN,
)

log = logging.getLogger(__name__)

SPILL_GLOB = "spill-*.jsonl"


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
        batch_age_s_max: float = WRITER_BATCH_AGE_S_MAX,
    ) -> None:
        assert queue_events_max >= 1 and batch_events_max >= 1 and batch_age_s_max >= 0
        self.store = store
        self.spill_dir = Path(spill_dir)
        self.spill_dir.mkdir(parents=True, exist_ok=True)
        self.queue_events_max = queue_events_max
        self.batch_events_max = batch_events_max
        self.batch_age_s_max = batch_age_s_max
        self._queue: deque[Event] = deque()
        self._lock = threading.Lock()  # put vs. the writer's switch between queue and spill file
        self._spill: LogWriter | None = None
        self._spill_path: Path | None = None
        # Closed spill files, oldest first; always older than everything in the queue.
        self._pending_files: deque[Path] = deque(sorted(self.spill_dir.glob(SPILL_GLOB)))
        self._file_number = 0
        self._start_ns = time.time_ns()
        self._in_flight: list[Event] = []
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self._stopping = False
        self._stopped = False
        self._deadline = float("inf")
        self._dumped = False
        self._counts = {
            "queued": 0, "spilled": 0, "written": 0, "duplicates": 0, "loaded_from_spill": 0,
            "failed_attempts": 0, "batches": 0, "rejected": 0, "dropped": 0, "spill_bad_lines": 0,
            "respilled": 0,
        }  # fmt: skip
        # queued + spilled: every event put, each counted once at put time. respilled: queued
        # events moved to a spill file at close. rejected: set aside in rejected-*.jsonl.
        self._last_error: str | None = None

    # -- the hot path ------------------------------------------------------

    def put(self, event: Event) -> None:
        """Queue one event; never blocks on the store (a deque append or a buffered file write)."""
        with self._lock:
            if self._spill is None and not self._stopped and len(self._queue) < self.queue_events_max:
                self._queue.append(event)
                self._counts["queued"] += 1
                return
            self._spill_locked((event,), "spilled")

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
        if self._thread is not None:
            self._thread.join()
        else:
            self._run()
        with self._lock:
            self._stopped = True  # from now on put spills
            # Puts that raced the thread's exit: newest of all, so they go after any dump.
            late = list(self._queue)
            self._queue.clear()
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
            out["queue_depth"] = len(self._queue)
            out["in_flight"] = len(self._in_flight)
            out["spill_files_pending"] = len(self._pending_files) + (self._spill is not None)
            out["spilling"] = self._spill is not None
            out["last_error"] = self._last_error
        return out

    # -- the writer thread -------------------------------------------------

    def _run(self) -> None:
        first_seen: float | None = None
        try:
            while True:
                if self._pending_files:
                    self._load_file(self._pending_files[0])
                    with self._lock:
                        self._pending_files.popleft()
                    continue
                queued = len(self._queue)
                if queued:
                    now = time.monotonic()
                    first_seen = now if first_seen is None else first_seen
                    if self._stopping or queued >= self.batch_events_max or now - first_seen >= self.batch_age_s_max:
                        self._in_flight = [self._queue.popleft() for _ in range(min(queued, self.batch_events_max))]
                        self._write(self._in_flight)
                        self._in_flight = []
                        first_seen = None if not self._queue else time.monotonic()
                        continue
                elif self._spill is not None:
                    self._swap_spill()
                    continue
                elif self._stopping:
                    return
                self._wake.wait(WRITER_IDLE_POLL_S)
        except _Deadline:
            self._dump_remaining()

    def _swap_spill(self) -> None:
        """The queue is written: close the spill file and make it the next thing to load."""
        with self._lock:
            if self._queue or self._spill is None:
                return
            assert self._spill_path is not None
            self._spill.close()
            self._pending_files.append(self._spill_path)
            self._spill = None

    def _write(self, batch: Sequence[Event], *, from_spill: bool = False) -> None:
        """Append one batch in one transaction, retrying with backoff until it lands or the deadline."""
        backoff = WRITER_RETRY_BACKOFF_S_MIN
        while True:
            try:
                inserted = self.store.append(batch)
            except ConflictError as error:
                if len(batch) == 1:
                    self._reject(batch[0], error)
                else:
                    log.error("kvledger writer: %s; isolating the conflicting events", error)
                    for event in batch:
                        self._write([event], from_spill=from_spill)
                return
            except Exception as error:  # any failure of the store: count it, keep the batch, retry
                with self._lock:
                    self._counts["failed_attempts"] += 1
                    self._last_error = str(error)
                log.warning("kvledger writer: batch of %d failed (%s); retrying", len(batch), error)
                if self._stopping and time.monotonic() + backoff > self._deadline:
                    raise _Deadline from error
                self._wake.wait(backoff)
                backoff = min(backoff * 2, WRITER_RETRY_BACKOFF_S_MAX)
                continue
            with self._lock:
                self._counts["written"] += inserted
                self._counts["duplicates"] += len(batch) - inserted
                self._counts["batches"] += 1
                if from_spill:
                    self._counts["loaded_from_spill"] += len(batch)
            return

    def _reject(self, event: Event, error: ConflictError) -> None:
        """Set aside an event whose (source, seq) the store holds with other content; never retried."""
        log.error("kvledger writer: %s; kept in %s", error, self.spill_dir / "rejected.jsonl")
        try:
            with LogWriter(self.spill_dir / "rejected.jsonl") as rejected:
                rejected.write(event)
        except OSError as io_error:
            error = ConflictError(f"{error}; and rejected.jsonl failed: {io_error}")
        with self._lock:
            self._counts["rejected"] += 1
            self._last_error = str(error)

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
            reader = LogReader(stream, str(path), skip_bad_lines=True)
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
        """The deadline passed: put the in-flight batch and the queue on disk, before the open spill file."""
        with self._lock:
            self._dumped = True
            fresh = [*self._in_flight, *self._queue]
            self._in_flight = []
            self._queue.clear()
            newer: list[Event] = []
            if self._spill is not None and self._spill_path is not None:
                # The open spill file holds events newer than the queue: they follow it in the new file.
                self._spill.close()
                self._spill = None
                with open(self._spill_path, "rb") as stream:
                    newer = list(LogReader(stream, str(self._spill_path), skip_bad_lines=True))
                self._spill_path.unlink()
            if fresh or newer:
                self._spill_locked(fresh, "respilled")
            if newer:
                assert self._spill is not None
                self._spill.write_many(newer)
                self._spill.flush()
