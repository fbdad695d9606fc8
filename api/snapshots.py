"""The service's snapshots: the live fold as of a store-wide cursor, so that a start folds only what follows.

A snapshot holds the ledger's state (`kvledger.ledger.store.snapshot` encodes it) and what `Live` derives from the
fold beside it (event counts, the transfers' order, the request index, latencies, the holdings plot), as of
cursor C. It is kept in the store's snapshots table under the source "" (no event has an empty source:
`kvledger.ledger.valid`), C as its seq. Snapshots are written in the background (`write_forever`), never on a
request's path; the newest two are kept. A snapshot is encoded out of the service's process, as Redis's
BGSAVE does: `write` forks under the fold lock, between two folded slices, and the child encodes and
compresses its copy-on-write copy of the fold and hands the body back through a pipe; the service stores
it. The fold waits only for the fork, and no copy or encoding holds the service's GIL: for a million events'
fold they are seconds of CPU, much of it single C calls (copying every side, encoding a list whole) that no
request could interleave with. The child needs memory for the pages the fold changes while it runs, and for
its copies and the document (up to about the fold's own size again).

Exactly once: a start folds the snapshot's events, then the tail after C in cursor order, as the running
service does. The snapshot records three things a start checks against the store, and is used only if all
three still hold:
- the store's id (`EventStore.store_id`, drawn once when the store was made): a snapshot copied from another
  store, whose cursors name other events, is refused;
- how many rows the fold had read up to C: the store must still hold exactly that many at cursors up to C.
  A row committed below C after the snapshot was taken (a concurrent writer whose transaction took a lower
  cursor and committed later; the PostgreSQL store's append rules it out with its table lock, another writer
  of the table might not) is never skipped, because the snapshot is then refused. Such a row is also missed
  by the running fold's tail; the refold a refused snapshot leads to takes it in;
- the (source, seq) of the event at C, the last it folded: the store must hold that event at C. SQLite gives
  a new row the highest rowid plus one, so once the newest rows are deleted, rows appended after take their
  cursors again: the count up to C is the same, the events are others, and a snapshot believed would skip
  them (and keep the deleted ones' effects).

A snapshot that cannot be used (corrupt: its CRC-32 does not match, or it does not decode or hang together;
another format; the fold's fields changed; another store's; the count or the last event above) is ignored
with a warning naming its cursor and why, and the next older one is tried; with none left the fold starts
from zero. Either way the state equals a fold of the whole store. One thing a start from a snapshot does not
rebuild: the Prometheus release-latency histogram (`kvledger.api.metrics`), fed as releases are folded, counts the
releases this process folded, as any Prometheus counter starts again with its process; the fold's own counts
(`kvledger_releases_total`, the latency percentiles of /audit/summary) are restored whole.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import anyio.to_thread
import msgspec
import zstandard

from kvledger.api.limits import SNAPSHOT_COST_FACTOR, frozen_at_start
from kvledger.api.live import Live, Written
from kvledger.ledger.advice import LatencyRecorder, RecorderPlain
from kvledger.ledger.collector import collector_paused
from kvledger.ledger.decisions import Key
from kvledger.ledger.events import KINDS, Event
from kvledger.ledger.fold import LedgerState
from kvledger.ledger.forked import ChildFailed, fork_making
from kvledger.ledger.series import HoldingSeries, SeriesPlain
from kvledger.ledger.side import requests_of
from kvledger.ledger.store import snapshot
from kvledger.ledger.store.base import EventStore, StoredSnapshot
from kvledger.ledger.store.snapshot import SnapshotFormatError

log = logging.getLogger(__name__)

SOURCE = ""
"""The snapshots table's source for the service's snapshots: no event source is empty."""

FORMAT = 4
"""Bumped whenever the document below changes (the ledger's own part has its own `snapshot.FORMAT`; 2: the
ledger's part nested, not a byte string, and `order` and `by_request` derived from the sides; 3: the
document compressed, `seal`; 4: the store's id and the last event folded)."""

ZSTD_LEVEL = 1
"""A million-event fold's 176 MB document: 20 MB in 0.24 s, back in 0.2 s (level 3: 18 MB, 0.34 s)."""

FOLDED = frozenset({
    "state", "cursor", "rows_folded", "last_folded", "events_by_kind", "order", "by_request", "latency", "last_ts",
    "holding", "fold_errors",
})  # fmt: skip
"""`Live`'s attributes a snapshot holds: everything the fold of the store's events builds."""

NOT_FOLDED = frozenset({
    "settings", "store", "store_error", "version", "caught_up_from", "ingest_failure", "audit_config",
    "fold_lock", "appender", "advanced", "replays_running", "uploads_running", "streams_open", "quarantined",
    "store_limiter", "snapshot_rows", "snapshot_written", "restored_from", "_on_release", "_restore", "_audit",
    "_finding_keys", "audited", "auditor",
})  # fmt: skip
"""`Live`'s other attributes: settings, locks, counters of the service itself. An attribute in neither set
makes `encode` fail loudly (a snapshot that silently dropped part of the fold would start a wrong service)."""


class _Document(msgspec.Struct, kw_only=True):
    format: int
    store_id: str
    """The id of the store it was taken of (`EventStore.store_id`): another store's is refused."""
    cursor: int
    rows: int
    """Rows read from the store's tail up to `cursor`: the store must still hold exactly these."""
    last_folded: tuple[str, int] | None
    """(source, seq) of the event at `cursor`: the store must still hold it there."""
    ledger: msgspec.Raw
    """The ledger's own document (`snapshot.encode`), nested as it is: decoded in place, never copied out."""
    events_by_kind: dict[str, int]
    order: list[Key] | None
    """None: `list(state.transfers)`, as it is unless the state forgot sides (`_order_written`)."""
    requests_apart: list[tuple[str, tuple[Key, ...]]]
    """`by_request`'s entries that differ from what the sides' maps say (`requests_of`), by request id."""
    requests_gone: list[str]
    """Request ids the sides' maps name that `by_request` does not have."""
    latency: RecorderPlain
    last_ts: dict[str, float]
    holding: SeriesPlain
    fold_errors: int


_encoder = msgspec.msgpack.Encoder()  # dicts in insertion order: their orders are part of what is restored
_decoder = msgspec.msgpack.Decoder(_Document)


class _Restored(NamedTuple):
    doc: _Document
    state: LedgerState
    order: list[Key]
    by_request: dict[str, tuple[Key, ...]]
    latency: LatencyRecorder
    holding: HoldingSeries


class _Taken(NamedTuple):
    """What a snapshot writes of `Live`, copied where the fold cannot move (`_take`): encoded while it goes on."""

    store_id: str
    cursor: int
    rows: int
    last_folded: tuple[str, int] | None
    ledger: snapshot.Document
    keys: list[Key]
    """The sides' keys, in the order of the sides `ledger` holds (what `requests_of` reads them by)."""
    events_by_kind: dict[str, int]
    order: list[Key] | None
    by_request: dict[str, tuple[Key, ...]]
    latency: RecorderPlain
    last_ts: dict[str, float]
    holding: SeriesPlain
    fold_errors: int


def encode(live: Live, store_id: str | None = None) -> tuple[int, int, bytes]:
    """(cursor, rows, body) of `live`'s fold. Call it where the fold cannot move (under `fold_lock`, or in
    `write`'s child). `store_id`: the store's, when known (else asked of `live.store`)."""
    taken = _take(live, store_id)
    return taken.cursor, taken.rows, seal(_encoded(taken))


def _take(live: Live, store_id: str | None = None) -> _Taken:
    unknown = sorted(set(vars(live)) - FOLDED - NOT_FOLDED)
    if unknown:
        raise SnapshotFormatError(f"Live's attributes {unknown} are in neither FOLDED nor NOT_FOLDED: "
                                  "update api/snapshots.py")  # fmt: skip
    if store_id is None:
        store_id = live.store.store_id() if live.store is not None else ""
    keys = list(live.state.transfers)
    return _Taken(
        store_id=store_id,
        cursor=live.cursor,
        rows=live.rows_folded,
        last_folded=live.last_folded,
        ledger=snapshot.take(live.state),
        keys=keys,
        events_by_kind=dict(live.events_by_kind),
        order=_order_written(live.order, keys),
        by_request=dict(live.by_request),  # its values are tuples: a copy of the dict is a copy of it all
        latency=live.latency.to_plain(),
        last_ts=dict(live.last_ts),
        holding=live.holding.to_plain(),
        fold_errors=live.fold_errors,
    )


def _encoded(taken: _Taken) -> bytes:
    """The document of what `_take` took (it shares nothing with the fold: no lock needed)."""
    derived = requests_of(taken.keys, list(snapshot.sides_taken(taken.ledger)))
    by_request = taken.by_request
    doc = _Document(
        format=FORMAT,
        store_id=taken.store_id,
        cursor=taken.cursor,
        rows=taken.rows,
        last_folded=taken.last_folded,
        ledger=msgspec.Raw(snapshot.encode_taken(taken.ledger)),
        events_by_kind=taken.events_by_kind,
        order=taken.order,
        requests_apart=sorted(
            (request_id, keys) for request_id, keys in by_request.items() if derived.get(request_id) != keys
        ),
        requests_gone=sorted(request_id for request_id in derived if request_id not in by_request),
        latency=taken.latency,
        last_ts=taken.last_ts,
        holding=taken.holding,
        fold_errors=taken.fold_errors,
    )
    return _encoder.encode(doc)


def _order_written(order: list[Key], keys: list[Key]) -> list[Key] | None:
    """`order` as written: None when it is the sides' own order, `keys` (the service forgets no side, so
    always; a million-event store's order was a twentieth of its start)."""
    return None if order == keys else list(order)


def seal(document: bytes) -> bytes:
    """`document` compressed (zstd), with the CRC-32 of that after it: a snapshot damaged in the store is
    refused, never half-believed. Compressed, a snapshot is a ninth of the bytes the store writes while
    it holds its write lock (SQLite's is the one ingest takes: 176 MB held it two seconds) and reads at
    a start."""
    compressed = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(document)
    return compressed + zlib.crc32(compressed).to_bytes(4, "little")


def unsealed(body: bytes) -> bytes:
    """The document `seal` wrote, its CRC-32 checked (`SnapshotFormatError` if it does not match)."""
    view = memoryview(body)
    if len(view) < 4 or zlib.crc32(view[:-4]) != int.from_bytes(view[-4:], "little"):
        raise SnapshotFormatError("its checksum does not match (damaged or cut short)")
    try:
        return zstandard.ZstdDecompressor().decompress(view[:-4])
    except zstandard.ZstdError as error:  # sealed by another format's code: no zstd frame
        raise SnapshotFormatError(f"does not decompress: {error}") from None


def _restore(store: EventStore, stored: StoredSnapshot) -> _Restored:
    """The snapshot decoded and checked against the store; `SnapshotFormatError` says why it cannot be used."""
    if stored.format != FORMAT:
        raise SnapshotFormatError(f"format {stored.format}, this code reads {FORMAT}")
    with ThreadPoolExecutor(1, thread_name_prefix="kvledger-snapshot-count") as pool:
        # The store counts (a scan of a million rows, its driver off the GIL) while the body decodes.
        counted = pool.submit(store.count_through, stored.seq)
        at_cursor = pool.submit(store.tail, stored.seq - 1, 1)
        doc = snapshot.decoded(_decoder, unsealed(stored.body), FORMAT, "body")
        if doc.cursor != stored.seq:
            raise SnapshotFormatError(f"its body is of cursor {doc.cursor}")
        if set(doc.events_by_kind) != set(KINDS):
            raise SnapshotFormatError("the event kinds changed since it was written")
        store_id = store.store_id()
        if doc.store_id != store_id:
            raise SnapshotFormatError(
                f"it was taken of another store (store id {doc.store_id!r}; this store's is {store_id!r}): "
                "copied here, its cursors name other events"
            )
        stored_rows, found = counted.result(), at_cursor.result()
    if stored_rows != doc.rows:
        raise SnapshotFormatError(
            f"the store holds {stored_rows} events at cursors up to {doc.cursor}, the snapshot folded {doc.rows} "
            "(events committed below its cursor after it was taken, or removed)"
        )
    _check_last_folded(doc, found)
    try:
        state = snapshot.decode(memoryview(doc.ledger))
        keys = list(state.transfers)
        by_request = requests_of(keys, list(state.transfers.values()))
        order = keys if doc.order is None else doc.order
        for request_id, apart in doc.requests_apart:
            by_request[request_id] = apart
        for request_id in doc.requests_gone:
            del by_request[request_id]
        latency, holding = LatencyRecorder.from_plain(doc.latency), HoldingSeries.from_plain(doc.holding)
        return _Restored(doc, state, order, by_request, latency, holding)
    except SnapshotFormatError:
        raise
    except Exception as error:  # a body that decodes but does not hang together: refused like a corrupt one
        raise SnapshotFormatError(f"inconsistent: {type(error).__name__}: {error}") from None


def _check_last_folded(doc: _Document, found: list[tuple[int, Event]]) -> None:
    """The store's event at the snapshot's cursor (`found`: the tail after the cursor before it) is the one the
    snapshot folded last; else `SnapshotFormatError` naming both."""
    if doc.last_folded is None:
        if doc.cursor:
            raise SnapshotFormatError(f"it names no event at its cursor {doc.cursor}")
        return
    source, seq = doc.last_folded
    if not found or found[0][0] != doc.cursor:
        raise SnapshotFormatError(
            f"the store holds no event at its cursor {doc.cursor}, where it folded {source!r} seq {seq} (removed)"
        )
    event = found[0][1]
    if (event.source, event.seq) != (source, seq):
        raise SnapshotFormatError(
            f"the store's event at its cursor {doc.cursor} is {event.source!r} seq {event.seq}, the snapshot folded "
            f"{source!r} seq {seq} there (events removed and others stored at their cursors since)"
        )


def load_newest(store: EventStore) -> _Restored | None:
    """The newest snapshot that can be used, older ones tried in turn; None: fold from zero."""
    below: int | None = None
    with collector_paused():
        while (stored := store.latest_snapshot(SOURCE, below)) is not None:
            try:
                restored = _restore(store, stored)
            except SnapshotFormatError as why:
                log.warning(
                    "kvledger service: snapshot at cursor %d (written at %.0f) ignored: %s; trying an older one, "
                    "else folding the store from its start", stored.seq, stored.created_ts, why,
                )  # fmt: skip
                below = stored.seq - 1
                continue
            if frozen_at_start(len(restored.state.transfers)):
                # Before the collector resumes: its first pass would otherwise walk the million tuples the
                # decoding just built (keys, decided entries) to find them all alive, 0.4 s of a start. The
                # service's startup freezes what it built anyway, and unfreezes it at shutdown (kvledger.api.app).
                gc.freeze()
            return restored
    return None


async def restore(live: Live, store: EventStore) -> int | None:
    """Start `live`'s fold (nothing folded yet) from the newest usable snapshot in `store`; its cursor, or
    None when there is none (the fold then starts from zero)."""
    if not live.settings.snapshots_read:
        return None
    async with live.fold_lock:
        if live.rows_folded:
            return None  # another start got here first
        restored = await live.store_call(load_newest, store)
        if restored is None:
            return None
        doc = restored.doc
        live.state, live.latency, live.holding = restored.state, restored.latency, restored.holding
        live.cursor, live.rows_folded, live.fold_errors = doc.cursor, doc.rows, doc.fold_errors
        live.last_folded = doc.last_folded
        live.events_by_kind, live.order, live.by_request = doc.events_by_kind, restored.order, restored.by_request
        live.last_ts = doc.last_ts
        live.version += 1
        live.snapshot_rows = doc.rows
        live.restored_from = doc.cursor
    log.info("kvledger service: started from the snapshot at cursor %d (%d events)", doc.cursor, doc.rows)
    return doc.cursor


def _save(store: EventStore, stored: StoredSnapshot, keep_from: int | None) -> None:
    store.save_snapshot(stored)
    if keep_from is not None:
        store.delete_snapshots(SOURCE, keep_from)


async def write(live: Live) -> Written | None:
    """Snapshot `live`'s fold now: a child forked under the fold lock encodes it (`kvledger.ledger.forked`) while
    the fold and the requests go on, and it is stored on a store thread."""
    store = live.store
    if store is None:
        return None
    store_id = await live.store_call(store.store_id)  # read here: the child asks no store anything
    async with live.fold_lock:
        started = time.perf_counter()
        cursor, rows = live.cursor, live.rows_folded
        child = fork_making(lambda: encode(live, store_id)[2])
        lock_s = time.perf_counter() - started
    try:
        body, encode_cpu_s = await anyio.to_thread.run_sync(child.result, abandon_on_cancel=True)
    except BaseException:
        child.kill()  # cancelled (the service stops) or failed: the child is reaped by `result`'s thread
        raise
    # Kept: the new one and the one before it (a start falls back to it should the new one not decode).
    keep_from = live.snapshot_written.cursor if live.snapshot_written is not None else live.restored_from
    started = time.perf_counter()
    await live.store_call(_save, store, StoredSnapshot(SOURCE, cursor, FORMAT, time.time(), body), keep_from)
    written = Written(cursor, rows, len(body), lock_s, encode_cpu_s, time.perf_counter() - started)
    live.snapshot_written, live.snapshot_rows = written, rows
    log.info("kvledger service: snapshot at cursor %d written (%d events, %d bytes; fold lock held %.3f s)",
             cursor, rows, len(body), lock_s)  # fmt: skip
    return written


SnapshotFailed = ChildFailed
"""The child `write` forked exited without a snapshot."""


def due(live: Live, waited_s: float) -> bool:
    """Whether a snapshot is due `waited_s` after the last was written (or the service started): after
    `snapshot_every_events` folded events or `snapshot_interval_s` with any, but never sooner than
    SNAPSHOT_COST_FACTOR times the CPU seconds the last one cost. Without that bound, a million events'
    fold (3 to 5 CPU seconds a snapshot) fed at 50k events a second was snapshotted every 2 s: more than a
    core of copying and encoding, and ingest fell to a third."""
    settings, written = live.settings, live.snapshot_written
    new = live.rows_folded - live.snapshot_rows
    if new <= 0 or (new < settings.snapshot_every_events and waited_s < settings.snapshot_interval_s):
        return False
    return written is None or waited_s >= SNAPSHOT_COST_FACTOR * written.encode_cpu_s


async def write_forever(live: Live) -> None:
    """The background task: a snapshot whenever one is `due`; a failure is logged and retried an interval
    later."""
    settings = live.settings
    last_at = time.monotonic()
    while True:
        await asyncio.sleep(settings.poll_interval_s)
        if not due(live, time.monotonic() - last_at):
            continue
        try:
            await write(live)
        except Exception:
            log.exception("kvledger service: snapshot not written; trying again in %s s", settings.snapshot_interval_s)
            await asyncio.sleep(settings.snapshot_interval_s)
        last_at = time.monotonic()
