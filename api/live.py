"""The live fold: the store's events folded by the ledger's own `LedgerState`, kept current by a poller.

Every event reaches the state in cursor order, applied by the ledger's fold: read
from the store's tail, or, for a batch this service just ingested right after what
it had folded, taken from the batch with the cursors the store gave it. So the
state always equals a fold of the store (the same order another replica would
fold) and an event is never folded twice. All
mutation happens on the event loop under `fold_lock`, so `async` handlers read a
state that no thread is changing; a batch is folded FOLD_SLICE_EVENTS at a time,
the loop serving requests between slices.

No request waits on a write. The audit a request without `?now=` answers is computed
off the request path (`audit_forever`, on a thread of its own under the fold lock)
and published whole as one immutable `Audited`, which handlers read without a lock;
snapshots are encoded in a forked child (`kvledger.api.snapshots`). Handlers never
take `fold_lock`.

Every store call goes through `store_call`, on threads of its own (at most
`store_threads_max`): a store that stalls holds those, never the threads or the
loop the endpoints served from memory need. An event the fold cannot take (the
fold never raises; this is the guard should it ever) is counted and passed over,
so that one stored event can never stop the service.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple, ParamSpec, TypeVar

import anyio.to_thread
from anyio import CapacityLimiter

from kvledger.api.ingest import append_decoded
from kvledger.api.limits import AUDIT_COST_FACTOR, FOLD_SLICE_EVENTS
from kvledger.api.settings import Settings
from kvledger.api.waits import wait_set
from kvledger.ledger.advice import LatencyRecorder
from kvledger.ledger.audit import Finding, audit, counts_by_code
from kvledger.ledger.collector import collector_paused, untrack
from kvledger.ledger.decisions import Key
from kvledger.ledger.events import KINDS, Event
from kvledger.ledger.fold import LedgerState
from kvledger.ledger.projection import ReleaseHook, fold_rows
from kvledger.ledger.series import HoldingSeries
from kvledger.ledger.sources import SourceHealth, judge_sources
from kvledger.ledger.store.base import Appended, EventStore, StoreError
from kvledger.ledger.store.connect import open_store
from kvledger.ledger.store.limits import TAIL_EVENTS_MAX

Restore = Callable[["Live", EventStore], Awaitable[int | None]]
"""Starts a fold from a snapshot of the store; the cursor it starts after, or None."""
P = ParamSpec("P")
T = TypeVar("T")

log = logging.getLogger(__name__)


class Written(NamedTuple):
    """A snapshot the service wrote: where, how large, and how long the fold waited for it."""

    cursor: int
    rows: int
    bytes: int
    lock_s: float
    """Seconds the fold lock was held to fork the child that encoded it (the fold waits that long)."""
    encode_cpu_s: float
    """CPU seconds the child took to copy, encode and compress the fold (none of it on the service's GIL)."""
    save_s: float


class Audited(NamedTuple):
    """One audit of the fold, as requests without `?now=` answer it: computed off the request path
    (`Live.audit_forever`), published by one assignment and never changed after (its list, dict and set
    included), so handlers read it without a lock."""

    version: int
    """The fold's `Live.version` it audited."""
    now: float
    findings: list[Finding]
    counts: dict[str, int]
    """`counts_by_code(findings)`."""
    keys: set[Key]
    """The sides with a finding."""
    cost_s: float
    """Seconds the audit took on its thread."""


RELEASE_SLICE = 2048
"""Findings (and keys) a replaced audit frees at a time (`_release`)."""


def _release(replaced: list[Audited | None]) -> None:
    """Free a replaced audit (the only reference to it, in `replaced`) on the audit thread, RELEASE_SLICE
    findings and keys at a time, the event loop taking the GIL between slices: freed whole where it was
    replaced, 100k findings and their keys held the loop for tens of milliseconds. A list or set someone still
    holds (a board built from it, a request answering from it) is left whole, freed when they let go."""
    audited = replaced.pop()
    if audited is None:
        return
    findings, keys = audited.findings, audited.keys
    del audited
    if sys.getrefcount(findings) == 2:  # this frame's and the call's own: no one else's
        while findings:
            del findings[-RELEASE_SLICE:]
    if sys.getrefcount(keys) == 2:
        while keys:
            for _ in range(min(RELEASE_SLICE, len(keys))):
                keys.pop()


class Live:
    """The folded state of one store and what the service derives from it."""

    def __init__(
        self, settings: Settings, on_release: ReleaseHook | None = None, *, restore: Restore | None = None
    ) -> None:
        self.settings = settings
        self._restore = restore
        """Starts the fold from a snapshot when the store is first opened (`kvledger.api.snapshots.restore`)."""
        self.store: EventStore | None = None
        self.store_error: str | None = "store not opened yet"
        self.state = LedgerState()
        self.cursor = 0
        self.rows_folded = 0
        """Rows read from the store's tail so far (a snapshot records it: `kvledger.api.snapshots`)."""
        self.last_folded: tuple[str, int] | None = None
        """(source, seq) of the event at `cursor`, the last folded (a snapshot records it: a start finds the
        same event at that cursor, or the store changed under the snapshot)."""
        self.version = 0
        """Bumped after every folded batch; keys the audit cache."""
        self.events_by_kind: dict[str, int] = dict.fromkeys(KINDS, 0)
        self.order: list[Key] = []
        """Transfer sides in first-seen order: positions are the pagination cursor."""
        self.by_request: dict[str, tuple[Key, ...]] = {}
        """Tuples, not lists: a tuple of strings is untracked by the garbage collector, so a few hundred
        thousand requests cost its full collections nothing (lists made them take seconds under load)."""
        self.latency = LatencyRecorder()
        self.last_ts: dict[str, float] = {}
        """Each source's newest event: how long a source has been silent (kvledger.ledger.sources)."""
        self.holding = HoldingSeries()
        """Blocks held per source over log time, for the page's plot."""
        self.caught_up_from = time.time()
        """Wall time a catch-up began that then read the store to its end: all stored before it is folded."""
        self.ingest_failure: tuple[float, str] | None = None
        """(wall time, why) of the last POST /events that stored nothing, unless one succeeded since."""
        self.audit_config = settings.audit_config()
        self.fold_lock = asyncio.Lock()
        self.appender = ThreadPoolExecutor(1, thread_name_prefix="kvledger-ingest")
        """Ingests' appends, one at a time in the order they came (the store's write lock would make others
        wait on its threads): see `append_ingested`. Their folds are not on it: `fold_appended` folds in
        cursor order whichever batch gets there first."""
        self.advanced = asyncio.Event()
        """Set (and replaced) whenever the cursor moves: live streams wait on it."""
        self.replays_running = 0
        self.uploads_running = 0
        self.streams_open = 0
        self.fold_errors = 0
        """Stored events the fold raised on (passed over; see the module's docstring). Always 0 so far."""
        self.quarantined = 0
        """Events in the store's quarantine (refused for their content), as of the last poll."""
        self.store_limiter = CapacityLimiter(settings.store_threads_max)
        self.restored_from: int | None = None
        """The cursor of the snapshot the fold started from (None: from the store's start)."""
        self.snapshot_written: Written | None = None
        self.snapshot_rows = 0
        """Rows the newest snapshot known (restored or written) covers: the next is due after more."""
        self._on_release = on_release
        self.audited: Audited | None = None
        """The newest published audit (`audit_forever`); None until the first (the app's start publishes one)."""
        self.auditor = ThreadPoolExecutor(1, thread_name_prefix="kvledger-audit")
        """The published audits' thread: off the event loop, requests are served while one runs."""
        # One tuple each, replaced whole: the page's board reads these from a worker thread.
        self._audit: tuple[tuple[int, float], list[Finding]] | None = None
        self._finding_keys: tuple[tuple[int, float], set[Key]] | None = None

    async def store_call(self, call: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """`call(*args)` on one of the store's own threads (see the module's docstring)."""
        return await anyio.to_thread.run_sync(lambda: call(*args, **kwargs), limiter=self.store_limiter)

    async def append_ingested(self, store: EventStore, events: list[Event]) -> Appended:
        """An ingest's batch appended (`append_decoded`) on the ingest thread. Queued there at once, in
        this coroutine's step: appends then run back to back while earlier batches fold on the event loop.
        Taken in turn under an asyncio lock, the next batch's append started only once the loop came back to
        its coroutine, after the fold of the one before (never beside it: each batch waited for the last)."""
        return await append_decoded(self.appender, store, events)

    async def catch_up(self, batch: int | None = None) -> int:
        """Fold everything the store holds after our cursor; returns how many events were folded."""
        store = self.store
        if store is None:
            return 0
        limit = min(batch or self.settings.tail_batch_max, TAIL_EVENTS_MAX)
        folded = 0
        started = time.time()
        while True:
            # The lock a batch at a time: under a sustained stream a catch-up never ends, and the published
            # audit, a snapshot's fork and the page's reads, which take the lock too, would wait for ever.
            async with self.fold_lock:
                rows = await self.store_call(store.tail, self.cursor, limit)
                if rows:
                    await self._fold_sliced(rows)
                    folded += len(rows)
                    self._advance()
            if len(rows) < limit:
                break
        self.caught_up_from = started
        return folded

    async def fold_appended(self, appended: Appended | None) -> None:
        """Fold what an ingest just stored: from the batch itself when the store held nothing unfolded
        before it (the events and cursors the store reported, so nothing is read back), else by `catch_up`.
        Either way every event is folded once, in cursor order."""
        if appended is not None and appended.inserted:
            async with self.fold_lock:
                if self.cursor == appended.after_cursor:
                    await self._fold_sliced(appended.inserted)
                    self._advance()
                    return
        await self.catch_up()

    def _advance(self) -> None:
        self.advanced.set()
        self.advanced = asyncio.Event()

    async def _fold_sliced(self, rows: list[tuple[int, Event]]) -> None:
        """Fold `rows` (under the caller's fold lock) FOLD_SLICE_EVENTS at a time, the event loop serving
        requests between slices. The state after each slice is the fold of the store up to its last cursor."""
        for first in range(0, len(rows), FOLD_SLICE_EVENTS):
            if first:
                await asyncio.sleep(0)
            self._fold(rows[first : first + FOLD_SLICE_EVENTS])

    def _fold(self, rows: list[tuple[int, Event]]) -> None:
        # Without the pause, a 1,000-event batch's fold set off several of the collector's passes, each over
        # the batch's new objects, that all live on in the state: nothing to free, a tenth of the fold's time.
        with collector_paused():
            self._fold_rows(rows)
            # Before the collector resumes: what the batch grew is kept out of its passes (kvledger.ledger.collector).
            untrack([*self.state.grown_containers(), self.order, self.by_request])

    def _fold_rows(self, rows: list[tuple[int, Event]]) -> None:
        failed = fold_rows(
            self.state, rows, self.events_by_kind, self.last_ts, self.order, self.by_request, self.holding,
            self.latency, self._on_release,
        )  # fmt: skip
        for cursor, event, error in failed:
            self.fold_errors += 1
            log.error("kvledger service: event at cursor %d (%s seq %d) could not be folded; passed over",
                      cursor, event.source, event.seq, exc_info=error)  # fmt: skip
        cursor, last = rows[-1]
        self.cursor, self.last_folded = cursor, (last.source, last.seq)
        self.rows_folded += len(rows)
        self.version += 1

    async def refresh(self, batch: int | None = None) -> None:
        """Open the store if it is not open yet, then catch up; a store outage is recorded, not raised."""
        try:
            if self.store is None:
                self.store = await self.store_call(open_store, self.settings.db)
                if not self.rows_folded and self._restore is not None:
                    await self._restore(self, self.store)  # the store failing meanwhile: a fold from zero
            await self.catch_up(batch)
            self.quarantined = await self.store_call(self.store.quarantined_count)
            self.store_error = None
        except StoreError as error:
            self.store_error = f"{type(error).__name__}: {error}"

    async def poll_forever(self) -> None:
        """The background task: fold new events every poll interval until cancelled; it outlives any error
        (a poller that died would leave the service answering from a state that never moves again)."""
        while True:
            await asyncio.sleep(self.settings.poll_interval_s)
            try:
                await self.refresh()
            except Exception as error:
                self.store_error = f"{type(error).__name__}: {error}"
                log.exception("kvledger service: poll failed; polling on")

    async def publish_audit(self) -> Audited:
        """Audit the fold at `clock_now()` on the audit thread, under the fold lock (the fold waits; requests
        go on, served between the thread's turns on the GIL), and publish it as `audited`."""
        async with self.fold_lock:
            loop = asyncio.get_running_loop()
            audited = await loop.run_in_executor(self.auditor, self._audit_now, self.version, self.clock_now())
        replaced, self.audited = [self.audited], audited
        self.auditor.submit(_release, replaced)
        return audited

    def _audit_now(self, version: int, now: float) -> Audited:
        started = time.perf_counter()
        findings = audit(self.state, now, self.audit_config)
        counts, keys = counts_by_code(findings), {(f.source, f.transfer_id) for f in findings}
        return Audited(version, now, findings, counts, keys, time.perf_counter() - started)

    async def audit_forever(self) -> None:
        """The background task: publish an audit once the fold or the clock (`clock_now`) moved past the
        published one, but never sooner than AUDIT_COST_FACTOR times the last one took after it began (a
        million events' audit under sustained ingest then costs the fold a tenth of its time at most)."""
        while True:
            audited = self.audited
            if audited is not None:
                await asyncio.sleep(max(0.0, AUDIT_COST_FACTOR * audited.cost_s - audited.cost_s))
            await self._moved_past(audited)
            try:
                await self.publish_audit()
            except Exception:
                log.exception("kvledger service: audit not published; trying again in a second")
                await asyncio.sleep(1.0)

    async def _moved_past(self, audited: Audited | None) -> None:
        """Return once the fold's version or the clock differs from `audited`'s."""
        resolution = self.settings.audit_cache_resolution_s
        while audited is not None and audited.version == self.version and audited.now == self.clock_now():
            await wait_set(self.advanced, max(0.0, audited.now + resolution - time.time()))  # or the clock's step

    def close(self) -> None:
        self.auditor.shutdown(wait=True)  # an audit under way reads the fold: it ends first
        self.appender.shutdown(wait=True)  # an append under way finishes before its store closes
        if self.store is not None:
            self.store.close()
            self.store = None

    def clock_now(self) -> float:
        """The server's clock rounded down to the audit cache resolution (what `now` defaults to)."""
        resolution = self.settings.audit_cache_resolution_s
        now = time.time()
        return now - (now % resolution) if resolution > 0 else now

    def published(self) -> Audited:
        """The newest published audit: what a request without `?now=` answers, read without a lock. At most
        AUDIT_COST_FACTOR audits' time behind the fold and the clock (its `now` says when it audited)."""
        audited = self.audited
        if audited is None:  # a `Live` used without the app, which publishes one at its start: on the loop
            audited = self.audited = self._audit_now(self.version, self.clock_now())
        return audited

    def findings_at(self, now: float | None) -> tuple[float, list[Finding]]:
        """(audit time, findings) at `now`, or the published audit's when None (`published`)."""
        if now is None:
            audited = self.published()
            return audited.now, audited.findings
        return now, self.findings(now)

    def findings(self, now: float) -> list[Finding]:
        """The ledger's audit at `now`, computed once per (state version, now) unless published for them."""
        key = (self.version, now)
        audited = self.audited
        if audited is not None and (audited.version, audited.now) == key:
            return audited.findings
        cached = self._audit
        if cached is None or cached[0] != key:
            cached = self._audit = (key, audit(self.state, now, self.audit_config))
        return cached[1]

    def health(self, now: float) -> dict[str, SourceHealth]:
        """Every source's health at `now`: which are lost (silent while holding blocks, or known dead)."""
        return judge_sources(
            self.state,
            self.last_ts,
            now,
            transfer_timeout_s=self.settings.transfer_timeout_s,
            dead=self.settings.dead_engines,
        )

    def keys_with_findings(self, now: float | None) -> set[Key]:
        """The sides with a finding at `now` (None: the published audit's)."""
        if now is None:
            return self.published().keys
        key = (self.version, now)
        audited = self.audited
        if audited is not None and (audited.version, audited.now) == key:
            return audited.keys
        findings = self.findings(now)
        cached = self._finding_keys
        if cached is None or cached[0] != key:
            cached = self._finding_keys = (key, {(f.source, f.transfer_id) for f in findings})
        return cached[1]
