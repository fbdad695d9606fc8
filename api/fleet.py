"""The service over a store's partitions, folded by worker processes (`kvledger serve --partitions`): a NATS
stream's, or a SQL store's (`kvledger.ledger.fleet.partition_count` of them, each worker reading the tail).

`Fleet` starts one worker process per owned partition, or per group of them when there are more than
cores (`kvledger.ledger.fleet.serve_worker`: each folds its partitions from their source, saves (and
acknowledges), and answers this process between deliveries). A worker that dies is started again; it
restores its partitions' snapshots and its source delivers again what it had not saved.

What the API answers, merged from the workers: every owned partition's `PartitionAnswer` at one `now` (its
findings without `double_owner`, its counts, the merge items of the maps it accepted and the releases it
decided after what the merge was told: the workers keep them all, so a service started again is told
everything) fed to one `kvledger.ledger.fleet.LiveMerge`, partitions this service does
not own counted as empty: the findings in the audit's order, `double_owner` judged on the per-source
ownership fed in stream order (`kvledger.ledger.partitioned.Merger`, as `kvledger replay --jobs` merges).
That is one fold of what the workers have folded; once every worker has folded the stream to its end, one
fold of the whole stream (of the owned partitions). The published audit (`GET /audit` without `?now=`) is
computed so, off the request path, at the clock rounded down to `audit_cache_resolution_s`, at most once
per AUDIT_COST_FACTOR times its cost. `GET /transfers` lists the workers' sides by the cursor of each
side's first event (the one-process order), `?cursor=` being that cursor; `GET /transfers/{id}` asks the
worker owning the id's partition.

Services splitting the partitions (`--partitions 0-7` on one machine, `8-15` on another) each answer for
their own partitions; `GET /fleet/answers?now=T` gives a service's partitions' whole answers (msgpack, every
merge item), and `merge_services` merges every service's into the whole stream's answer (each partition
exactly once).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import queue
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, NamedTuple, ParamSpec, TypeVar

import msgspec

from kvledger.api.fleet_figures import FleetFigures, merge_figures
from kvledger.api.ingest import append_decoded
from kvledger.api.limits import AUDIT_COST_FACTOR
from kvledger.api.settings import Settings
from kvledger.ledger.audit import Finding, counts_by_code
from kvledger.ledger.collector import collector_paused
from kvledger.ledger.decisions import Key
from kvledger.ledger.events import Event, TransferId
from kvledger.ledger.fleet import (
    LiveMerge,
    SidesAsked,
    merge_pages,
    merge_request_sides,
    partition_count,
    serve_worker,
    through_cursor,
)
from kvledger.ledger.partition import partition_of
from kvledger.ledger.partitioned import Folded, Merged, PartitionAnswer, answer, merge
from kvledger.ledger.store.base import Appended
from kvledger.ledger.transfer_state import TransferState

log = logging.getLogger(__name__)
P = ParamSpec("P")
T = TypeVar("T")

_answers = msgspec.msgpack.Decoder(tuple[float, list[PartitionAnswer]])
"""A worker's answers, with the seconds it took to make them."""
_service_answers = msgspec.msgpack.Decoder(list[PartitionAnswer])
_sides = msgspec.msgpack.Decoder(tuple[list[tuple[int, TransferState]], int | None])
_transfer = msgspec.msgpack.Decoder(list[TransferState])
_request = msgspec.msgpack.Decoder(tuple[bool, list[tuple[int, TransferState]]])
_found = msgspec.msgpack.Decoder(list[float])
_status = msgspec.msgpack.Decoder(dict[int, tuple[int, int, int, int]])
_reply = msgspec.msgpack.Decoder(tuple[str, int, bytes])
_encode = msgspec.msgpack.Encoder().encode

FETCH_TIMEOUT_S = 0.05
"""How long a worker's fetch waits where nothing is new: the longest a request waits on an idle worker."""
PUBLISH_EVERY_S_MIN = 0.2
"""The published audit is replaced at most this often (and at most once per AUDIT_COST_FACTOR times its cost):
each asks every worker to audit its partitions, which holds its fold meanwhile."""
WATCH_EVERY_S = 0.5
"""How often dead workers are looked for (and started again)."""


def parse_partitions(text: str, partitions: int) -> list[int]:
    """`"0-7"`, `"0,2,5-6"` or `"all"` as partition numbers within `range(partitions)`."""
    if text.strip() == "all":
        return list(range(partitions))
    out: set[int] = set()
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        try:
            lo, hi = int(first), int(last or first)
        except ValueError:
            raise ValueError(f"--partitions {text!r}: numbers and ranges, e.g. 0-7 or 0,2,5-6, or all") from None
        if not 0 <= lo <= hi < partitions:
            raise ValueError(f"--partitions {text!r}: the store has partitions 0-{partitions - 1}")
        out.update(range(lo, hi + 1))
    return sorted(out)


def groups(owned: Sequence[int], workers: int) -> list[list[int]]:
    """`owned` shared out among `workers` processes (at most one per partition), round robin."""
    n = max(1, min(workers, len(owned)))
    return [list(owned[w::n]) for w in range(n)]


class FleetAudited(NamedTuple):
    """A published merged audit (as `kvledger.api.live.Audited`): replaced whole, read without a lock."""

    now: float
    findings: list[Finding]
    counts: dict[str, int]
    keys: set[Key]
    events: int
    cost_s: float
    figures: FleetFigures
    """What the page, the summary and the metrics read besides (`kvledger.api.fleet_figures`)."""
    oldest: TransferState | None
    """The oldest side held on a live engine (`figures.oldest_key`'s state)."""
    found_at: list[float]
    """When each finding became true (`kvledger.ledger.audit.found_at`): the findings-over-time plot."""


class WorkerLost(RuntimeError):
    """A worker exited before it answered (it is started again; ask again)."""


class _Worker:
    """One worker process and its connection; replies are matched to requests by id."""

    def __init__(self, fleet: Fleet, partitions: list[int]) -> None:
        self.fleet = fleet
        self.partitions = partitions
        self.process: Any = None
        self.conn: Any = None
        self.ready = asyncio.Event()
        self.waiting: dict[int, asyncio.Future[bytes]] = {}
        self.outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        """What `ask` sends, sent on a thread of its own (`_send`): a worker that does not read (busy, stopped)
        fills its pipe, and a send into a full pipe blocks; the event loop never does."""

    def start(self) -> None:
        context = multiprocessing.get_context("spawn")  # the service's loop and threads are not forked
        parent, child = context.Pipe(duplex=True)
        f = self.fleet
        self.process = context.Process(
            target=serve_worker, args=(child, f.settings.db, self.partitions, f.service, FETCH_TIMEOUT_S),
            name=f"kvledger-worker-{self.partitions[0]}", daemon=True,
        )  # fmt: skip
        self.process.start()
        child.close()
        if self.ready.is_set():
            self.ready = asyncio.Event()
        self.connect(parent, asyncio.get_running_loop())

    def connect(self, conn: Any, loop: asyncio.AbstractEventLoop) -> None:
        """Talk to the worker over `conn` (its pipe's end) from `loop`: a thread reads the replies, another
        sends what `ask` puts in a new outbox (the last one's sender, if any, ends)."""
        self.conn = conn
        self.outbox.put(None)
        self.outbox = queue.SimpleQueue()
        threading.Thread(target=self._read, args=(conn, loop), daemon=True).start()
        threading.Thread(target=self._send, args=(conn, self.outbox, loop), daemon=True).start()

    def _send(self, conn: Any, outbox: queue.SimpleQueue[bytes | None], loop: asyncio.AbstractEventLoop) -> None:
        while (message := outbox.get()) is not None:
            try:
                conn.send_bytes(message)
            except (OSError, ValueError):  # its end is gone: the worker died (`_watch` starts it again)
                loop.call_soon_threadsafe(self._lost, conn)
                return

    def _read(self, conn: Any, loop: asyncio.AbstractEventLoop) -> None:
        while True:
            try:
                kind, rid, payload = _reply.decode(conn.recv_bytes())
            except (EOFError, OSError):
                loop.call_soon_threadsafe(self._lost, conn)
                return
            loop.call_soon_threadsafe(self._reply, kind, rid, payload)

    def _reply(self, kind: str, rid: int, payload: bytes) -> None:
        if kind == "ready":
            self.ready.set()
            return
        future = self.waiting.pop(rid, None)
        if future is not None and not future.done():
            future.set_result(payload)

    def _lost(self, conn: Any) -> None:
        """The worker's connection ended: what was asked of it fails (`WorkerLost`), what is asked next waits
        for the worker started again (`Fleet._watch`)."""
        if conn is not self.conn:
            return
        if self.ready.is_set():
            self.ready = asyncio.Event()
        for future in self.waiting.values():
            if not future.done():
                future.set_exception(WorkerLost(f"the worker of partitions {self.partitions} exited"))
        self.waiting.clear()

    async def ask(self, kind: str, *args: Any) -> bytes:
        await self.ready.wait()
        rid = self.fleet.next_id()
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self.waiting[rid] = future
        self.outbox.put(_encode([kind, rid, *args]))
        try:
            return await future
        finally:  # an ask given up (a probe's timeout, a client gone) is not kept for a worker that never answers
            self.waiting.pop(rid, None)

    def stop(self) -> None:
        self.outbox.put(_encode(["stop"]))
        self.outbox.put(None)  # the sender's end, after the stop
        self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()


class Fleet:
    """The worker processes of one service and the merge of their answers (see the module docstring)."""

    def __init__(self, settings: Settings, partitions: str, *, service: str, workers: int | None = None) -> None:
        self.settings = settings
        self.partitions_text = partitions
        self.service = service
        self.workers_wanted = workers
        self.partitions = 0
        """The store's partition count."""
        self.owned: list[int] = []
        self.workers: list[_Worker] = []
        self.audited: FleetAudited | None = None
        self.restarts = 0
        self._ids = 0
        self._tasks: list[asyncio.Task[None]] = []
        self.store: Any = None
        self.live_merge = LiveMerge(1, [0])
        self.merging = threading.Lock()
        self.merger = ThreadPoolExecutor(1, thread_name_prefix="kvledger-merge")
        """The merges' thread (`merge_replies`): its own, so that requests reading the store on other threads
        (a transfer's timeline, which scans a partition's subjects) never hold back the published audit."""
        self.store_threads = ThreadPoolExecutor(settings.store_threads_max, thread_name_prefix="kvledger-store")
        """The store's reads (`store_call`: timelines, the event tail, probes): a bounded pool of their own, as
        the one-process service's."""
        self.appender = ThreadPoolExecutor(1, thread_name_prefix="kvledger-ingest")
        """POST /events' appends, one at a time in the order they came (`append_ingested`)."""
        self.advanced = asyncio.Event()
        """Set (and replaced) when the store may hold events an event stream has not read: a batch ingested
        here, or a published audit over more events than the last (what the engines appended themselves)."""
        self.streams_open = 0
        self.audit_config = settings.audit_config()
        """What an uploaded log's replay audits with (POST /replay): the settings the workers audit with."""
        self.uploads_running = 0
        self.replays_running = 0
        self.ingest_failure: tuple[float, str] | None = None
        """(when, why) the last POST /events stored nothing (`kvledger.api.routes.events.failure_recorded`)."""

    def next_id(self) -> int:
        self._ids += 1
        return self._ids

    async def open(self) -> None:
        """Start the workers and wait until each has restored its partitions; publish a first audit."""
        import os

        from kvledger.ledger.store.connect import open_store

        self.store = await asyncio.to_thread(open_store, self.settings.db)
        self.partitions = partition_count(self.store)
        self.owned = parse_partitions(self.partitions_text, self.partitions)
        try:
            cores = max(1, len(os.sched_getaffinity(0)))
        except AttributeError:
            cores = max(1, os.cpu_count() or 1)
        self.live_merge = LiveMerge(self.partitions, self.owned)
        self.workers = [_Worker(self, g) for g in groups(self.owned, self.workers_wanted or cores)]
        for worker in self.workers:
            worker.start()
        for worker in self.workers:
            await worker.ready.wait()
        await self.publish()
        self._tasks = [
            asyncio.create_task(self._watch(), name="kvledger-fleet-watch"),
            asyncio.create_task(self._audit_forever(), name="kvledger-fleet-audit"),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await asyncio.gather(*(asyncio.to_thread(w.stop) for w in self.workers))
        self.appender.shutdown(wait=True)  # an append under way finishes before its store closes
        if self.store is not None:
            self.store.close()
        self.merger.shutdown(wait=False)
        self.store_threads.shutdown(wait=False)

    async def _watch(self) -> None:
        """Start again a worker that died (it restores its partitions' snapshots and goes on)."""
        while True:
            await asyncio.sleep(WATCH_EVERY_S)
            for worker in self.workers:
                if not worker.process.is_alive():
                    log.warning("kvledger fleet: worker of partitions %s exited (%s); starting it again",
                                worker.partitions, worker.process.exitcode)  # fmt: skip
                    worker._lost(worker.conn)
                    worker.conn.close()
                    worker.start()
                    self.restarts += 1

    # -- answers -----------------------------------------------------------------------------------------------

    async def replies(self, now: float, since: dict[int, int]) -> list[bytes]:
        """Every worker's answers at `now`, telling each partition's merge items after `since[partition]`,
        encoded (decoded off the event loop: `merge_replies`)."""
        s = self.settings
        return list(
            await asyncio.gather(
                *(w.ask("answer", now, s.transfer_timeout_s, s.clock_skew_s, since) for w in self.workers)
            )
        )

    def merge_replies(self, replies: list[bytes], now: float) -> tuple[list[Finding], int, float, FleetFigures]:
        """The workers' answers at `now` fed to the service's `LiveMerge` (one at a time): merged findings, events,
        what the audit cost, and the figures beside the findings (`merge_figures`, read of the merge as it stands
        after them).

        The cost is the CPU seconds of the process that spent most on it, so that none spends more than its
        share on audits: the slowest worker's answers (they run side by side, each holding its fold), or this
        merge (in the service, after them) less feeding the merge items (`LiveMerge.feed`). Those are the
        stream's maps and releases since the last audit, as much work however often it runs; counted in, an
        audit that came later cost more and made the next come later still, without end (the published audit
        fell behind the stream by tens of seconds at a steady rate). CPU seconds, not wall: on a loaded machine
        one audit's wall time, stretched by other processes, put off the next by ten times as much."""
        began = time.thread_time()  # this thread's (`findings_now` runs it on one of its own)
        # Decoding and feeding make many objects and no cycles: the collector's passes over them (and over
        # the merge's whole ownership) free nothing, and stall the requests the event loop serves meanwhile.
        with collector_paused():
            decoded = [_answers.decode(reply) for reply in replies]
        answers = [a for _, part in decoded for a in part]
        with self.merging:
            feeding = time.thread_time()
            with collector_paused():
                self.live_merge.feed(answers)
            fed_s = time.thread_time() - feeding
            findings, events = self.live_merge.findings(answers)
            through = self.told_through()
            ownership = self.live_merge.merger.ownership
            figures = merge_figures(answers, findings, ownership, now, self.settings, through=through)
        cost_s = max(max((s for s, _ in decoded), default=0.0), time.thread_time() - began - fed_s)
        return findings, events, cost_s, figures

    def told_through(self) -> int:
        """The least position through which every owned partition has told the merge what it folded."""
        return min(self.live_merge.told[p] for p in self.owned)

    async def findings_now(self, now: float) -> tuple[list[Finding], int, float, FleetFigures]:
        """Every owned partition asked at `now`, merged (`LiveMerge`): findings, events, cost, figures."""
        since = {p: self.live_merge.told[p] for p in self.owned}  # told twice at worst: `LiveMerge` passes it over
        replies = await self.replies(now, since)
        return await asyncio.get_running_loop().run_in_executor(self.merger, self.merge_replies, replies, now)

    async def audit(self, now: float) -> FleetAudited:
        """The merged audit at `now`, with its figures and the oldest side held on a live engine."""
        findings, events, cost_s, figures = await self.findings_now(now)
        found_at = self.found_at(findings, figures.found_at)
        oldest, found = await asyncio.gather(self._oldest(figures.oldest_key), found_at)
        keys = {(f.source, f.transfer_id) for f in findings}
        return FleetAudited(now, findings, counts_by_code(findings), keys, events, cost_s, figures, oldest, found)

    async def _oldest(self, key: Key | None) -> TransferState | None:
        """The side `key` names (`FleetFigures.oldest_key`), from the worker folding it."""
        if key is None:
            return None
        source, transfer_id = key
        return next((t for t in await self.transfer(transfer_id) if t.source == source), None)

    async def found_at(self, findings: list[Finding], told: list[float | None]) -> list[float]:
        """`told` (each finding's time, as its partition said) with those the merge judged asked of the workers
        folding their sides."""
        asked: dict[int, list[int]] = {}
        for i, at in enumerate(told):
            if at is None:
                partition = partition_of(findings[i].transfer_id, self.partitions)
                asked.setdefault(next(k for k, w in enumerate(self.workers) if partition in w.partitions), []).append(i)
        out = [at if at is not None else 0.0 for at in told]
        s = self.settings
        replies = await asyncio.gather(
            *(
                self.workers[k].ask("found", [findings[i] for i in indices], s.transfer_timeout_s, s.clock_skew_s)
                for k, indices in asked.items()
            )
        )
        for indices, reply in zip(asked.values(), replies, strict=True):
            for i, at in zip(indices, _found.decode(reply), strict=True):
                out[i] = at
        return out

    async def audited_at(self, now: float | None) -> FleetAudited:
        """The published audit (None), or one at `now`."""
        if now is None:
            audited = self.audited
            assert audited is not None  # published before the app serves
            return audited
        return await self.audit(now)

    async def answers(self, now: float) -> list[PartitionAnswer]:
        """Every owned partition's whole answer at `now` (every merge item it folded), for a merge elsewhere."""
        replies = await self.replies(now, dict.fromkeys(self.owned, 0))
        return [a for reply in replies for a in _answers.decode(reply)[1]]

    async def publish(self) -> FleetAudited:
        """Publish the merged audit at the clock. Its cost is CPU time (the workers' audits and the merge), not
        the time the answers took to come: a worker answers between two deliveries, and the wait for one
        holds no CPU."""
        audited = await self.audit(self.clock_now())
        before, self.audited = self.audited, audited
        if before is None or audited.events != before.events:
            self._advance()
        return audited

    def _advance(self) -> None:
        self.advanced.set()
        self.advanced = asyncio.Event()

    async def append_ingested(self, events: list[Event]) -> Appended:
        """An ingested batch appended to the store (`append_decoded`) on the ingest thread, in the order batches
        came. The workers fold it from the store, as every other event."""
        appended = await append_decoded(self.appender, self.store, events)
        self._advance()
        return appended

    async def _audit_forever(self) -> None:
        while True:
            audited = self.audited
            wait = AUDIT_COST_FACTOR * audited.cost_s - audited.cost_s if audited is not None else 0.0
            await asyncio.sleep(max(wait, PUBLISH_EVERY_S_MIN))
            try:
                await self.publish()
            except Exception:
                log.exception("kvledger fleet: audit not published; trying again in a second")
                await asyncio.sleep(1.0)

    def clock_now(self) -> float:
        resolution = self.settings.audit_cache_resolution_s
        now = time.time()
        return now - (now % resolution) if resolution > 0 else now

    async def findings_at(self, now: float | None) -> tuple[float, list[Finding], dict[str, int], set[Key]]:
        """The published audit's (None), or the merged findings at `now` without what only the summary and the
        page read (`audit`'s asks of the workers for the findings' times and the oldest held side)."""
        if now is None:
            audited = await self.audited_at(None)
            return audited.now, audited.findings, audited.counts, audited.keys
        findings = (await self.findings_now(now))[0]
        return now, findings, counts_by_code(findings), {(f.source, f.transfer_id) for f in findings}

    async def sides(self, asked: SidesAsked, keys: set[Key] | None) -> tuple[list[TransferState], int | None]:
        """A page of every worker's matching sides after `asked.cursor`, in first-cursor order, and the cursor
        the next page starts after (None: this page reached the end)."""

        async def one(worker: _Worker) -> tuple[list[tuple[int, TransferState]], int | None]:
            mine = set(worker.partitions)
            flagged = None
            if keys is not None:
                flagged = [k for k in keys if partition_of(k[1], self.partitions) in mine]
            ask = msgspec.structs.replace(asked, flagged=flagged)
            return _sides.decode(await worker.ask("sides", ask))

        return merge_pages(await asyncio.gather(*(one(w) for w in self.workers)), asked.limit)

    async def transfer(self, transfer_id: str) -> list[TransferState]:
        partition = partition_of(TransferId(transfer_id), self.partitions)
        worker = next((w for w in self.workers if partition in w.partitions), None)
        if worker is None:
            return []
        return _transfer.decode(await worker.ask("transfer", transfer_id))

    async def request(self, request_id: str) -> list[TransferState] | None:
        """The sides maps named `request_id` for, in the order they were first named (None: none named it)."""
        replies = await asyncio.gather(*(w.ask("request", request_id) for w in self.workers))
        return merge_request_sides([_request.decode(reply) for reply in replies])

    async def status(self) -> dict[int, tuple[int, int, int, int]]:
        """Per owned partition: events folded, complete through, last applied, restored from (stream seqs)."""
        replies = await asyncio.gather(*(w.ask("status") for w in self.workers))
        return {p: v for reply in replies for p, v in _status.decode(reply).items()}

    async def status_within(self, timeout_s: float) -> tuple[dict[int, tuple[int, int, int, int]], list[list[int]]]:
        """`status` of the workers that answered within `timeout_s`, and the partitions of each that did not
        (stopped, hung, or being started again)."""

        async def one(worker: _Worker) -> dict[int, tuple[int, int, int, int]] | None:
            try:
                async with asyncio.timeout(timeout_s):
                    return _status.decode(await worker.ask("status"))
            except (TimeoutError, WorkerLost):
                return None

        replies = await asyncio.gather(*(one(w) for w in self.workers))
        silent = [w.partitions for w, reply in zip(self.workers, replies, strict=True) if reply is None]
        return {p: v for reply in replies if reply is not None for p, v in reply.items()}, silent

    async def store_call(self, call: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """`call(*args)` on `store_threads`: a stalled store holds those, never the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.store_threads, partial(call, *args, **kwargs))

    async def timeline(self, transfer_id: str, events_max: int) -> list[Event]:
        """A transfer's events from the store (on `store_threads`)."""
        from kvledger.api.transfer_events import transfer_events

        return await self.store_call(transfer_events, self.store, transfer_id, events_max)


def merge_answers(answers: list[PartitionAnswer], partitions: int, now: float, *, complete: bool) -> Merged:
    """`answers` (each partition at most once) merged as one fold's answer; with `complete`, every one of
    `range(partitions)` must be there, else the missing ones are counted as empty. Each answer's merge items
    are taken as told up to one stream position (the furthest any answer reached)."""
    have = {a.partition for a in answers}
    if len(have) != len(answers) or any(a.partitions != partitions for a in answers):
        raise ValueError(f"answers for partitions {sorted(a.partition for a in answers)} of {partitions}: one each")
    missing = [p for p in range(partitions) if p not in have]
    if complete and missing:
        raise ValueError(f"no answer for partitions {missing}")
    parts = list(answers) + [answer(Folded(p, partitions), now) for p in missing]
    upto = max((a.rest.upto for a in parts), default=through_cursor(0))
    for a in parts:
        a.rest.upto = upto
    return merge(parts)


def merge_services(urls: Sequence[str], now: float, timeout_s: float = 60.0) -> Merged:
    """The whole stream's answer at `now` from services that split its partitions between them (each
    partition owned by exactly one): every service's `GET /fleet/answers?now=`, merged."""
    answers: list[PartitionAnswer] = []
    partitions = 0
    for url in urls:
        with urllib.request.urlopen(f"{url.rstrip('/')}/fleet/answers?now={now!r}", timeout=timeout_s) as response:
            partitions = int(response.headers["Kvledger-Partitions"])
            answers += _service_answers.decode(response.read())
    return merge_answers(answers, partitions, now, complete=True)
