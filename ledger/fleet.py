"""A partition worker: some partitions of a store, each folded from its source, saved (and, from a NATS
stream, acknowledged) so that a worker started after a crash goes on where the last saved fold was.

The source (`kvledger.ledger.store.partition_source.PartitionSource`) is a NATS stream's durable consumers
(`kvledger.ledger.store.nats_consumer.PartitionConsumers`, a position being a stream sequence) or a SQL
store's tail in cursor order (`kvledger.ledger.store.partition_source.StoreTail`, a position being a
cursor; every worker reads every row and keeps its partitions' events). Each owned partition is a
`PartitionFold`: `kvledger.ledger.partitioned.Folded` fed the source's deliveries (`Delivered`) as they
come, each event's position in the whole stream being its store cursor (cursors grow with the stream, so
the merge's index order is the stream's order: `Merger` and `answer` take them as they take a log's line
positions). A partition's fold never waits on another's.

Exactly once. A message is acknowledged only once a saved snapshot of the partition's fold holds it: the
worker saves (`save`: the fold and the position it holds, in the store's snapshots under `snapshot_source`:
a NATS stream's object store, a SQL store's snapshots table) every `FLEET_SNAPSHOT_EVERY_S` seconds or
`FLEET_SNAPSHOT_EVERY_EVENTS` events while it folds, and when it stops, and then acknowledges through the
saved sequence. A worker started again restores the newest snapshot (`restore`) and binds to the same
durable consumers: what was acknowledged is in the snapshot; what came after is delivered again, and a
message the snapshot holds already (a crash between a save and its acknowledgement) is recognised by its
stream sequence, one stored batch of one source's seqs, and passed over. From a SQL store a worker started
again reads the tail from the least position its restored folds hold, each partition passing over what its
fold holds. `digest` adds up every folded event's (source, seq) (its crc32 and seq)
so a test can see that each was folded once.

The fold itself is sans-IO; `run_worker` is the loop around the consumer and the store, `serve_worker` a
service's worker process around it (`kvledger serve --partitions`), and `LiveMerge` the service's merge of
its workers' answers as they come again and again.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
import zlib
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from operator import attrgetter, itemgetter
from typing import TYPE_CHECKING, Any

import msgspec

from kvledger.ledger.advice import LatencyRecorder, RecorderPlain
from kvledger.ledger.audit import AuditConfig, Finding, finding_order, found_at
from kvledger.ledger.collector import collector_paused, untrack
from kvledger.ledger.decisions import Key
from kvledger.ledger.events import KIND_OF_TYPE, KINDS, Drop, Event, Map, TransferId
from kvledger.ledger.forked import fork_making
from kvledger.ledger.limits import FLEET_SNAPSHOT_EVERY_EVENTS, FLEET_SNAPSHOT_EVERY_S, SNAPSHOT_COST_FACTOR
from kvledger.ledger.partitioned import Batch, Folded, Merger, PartitionAnswer, answer, fold_partition
from kvledger.ledger.picture import picture_of
from kvledger.ledger.store import snapshot
from kvledger.ledger.store.base import StoredSnapshot, StoreUnavailable
from kvledger.ledger.store.nats_stream import CURSOR_SHIFT
from kvledger.ledger.store.partition_source import SQL_PARTITIONS, Held, Mark
from kvledger.ledger.store.snapshot import SnapshotFormatError
from kvledger.ledger.transfer_state import TransferState

if TYPE_CHECKING:
    from kvledger.ledger.store.base import EventStore
    from kvledger.ledger.store.partition_source import Delivered, PartitionSource

FORMAT = 4
DIGEST_MASK = (1 << 64) - 1


_index = attrgetter("index")
_first_of = itemgetter(0)


def through_cursor(stream_seq: int, shift: int = CURSOR_SHIFT) -> int:
    """The highest cursor of the message at `stream_seq`: every event of it and of earlier messages is below
    (`shift` 0: a SQL store, whose positions are cursors)."""
    return (stream_seq << shift) | ((1 << shift) - 1)


def is_stream(store: EventStore) -> bool:
    """Whether `store` is a NATS stream (partitions of its own, durable consumers), not a SQL store."""
    return hasattr(store, "partitions")


def cursor_shift(store: EventStore) -> int:
    """How a position of `store` makes its cursors (`position << shift | place`): a NATS stream's message
    sequence, CURSOR_SHIFT; a SQL store's cursor, 0."""
    return CURSOR_SHIFT if is_stream(store) else 0


def partition_count(store: EventStore) -> int:
    """The partitions a worker folds `store` in: a NATS stream's own count, `SQL_PARTITIONS` for a SQL store."""
    return int(getattr(store, "partitions", SQL_PARTITIONS))


def snapshot_source(service: str, partition: int, partitions: int, *, stream: bool = True) -> str:
    """The name a partition's snapshots are kept under in the store. In a NATS stream's object store it
    starts with NUL (no event's source can). In a SQL store's snapshots table (whose text cannot hold a NUL
    on PostgreSQL) it starts with U+001F, the unit separator, and names `partition:`: that table's other
    snapshots are the one-process service's (source "", `kvledger.api.snapshots`) and a recovering
    engine's (under its own source, `kvledger.ledger.store.recovery`); neither reads these."""
    if stream:
        return f"\x00fleet:{service}:{partition}/{partitions}"
    return f"\x1fpartition:{service}:{partition}/{partitions}"


class _Saved(msgspec.Struct, kw_only=True, array_like=True):
    format: int
    partition: int
    partitions: int
    applied: int
    upto: int
    digest: int
    events: int
    first_index: int
    first_ts: float | None
    last_ts: float | None
    stream_events: int
    stream_last_ts: float | None
    next_compaction: int
    latencies: RecorderPlain
    pending: Batch
    state: msgspec.Raw
    order: list[tuple[str, TransferId]] = []
    first: list[int] = []
    source_last_ts: dict[str, float] = {}
    events_by_kind: dict[str, int] = {}
    first_map: tuple[int, float] | None = None
    mark: Mark | None = None
    by_request: dict[str, tuple[tuple[int, tuple[str, TransferId]], ...]] = {}
    holding_end_ts: float | None = None


_saved_decoder = msgspec.msgpack.Decoder(_Saved)
_encode = msgspec.msgpack.Encoder().encode


class PartitionFold:
    """One partition's fold from its consumer, and where in the stream it is.

    It never compacts: it keeps every side, as the one-process service does. An offline partition's fold
    (`kvledger.ledger.partitioned.fold_partition` over `slices`) compacts at the whole stream's clock (each
    chunk's events and newest ts, every partition's), so its state is one fold's restricted to its transfers.
    A worker is delivered its partition's messages alone: the only clock it has is its own, and a compaction
    at it would cut where no one fold cuts, a forgetting no property test holds to change no decision or
    finding."""

    def __init__(
        self,
        partition: int,
        partitions: int,
        *,
        keep_releases: bool = False,
        track_sides: bool = False,
        cursor_shift: int = CURSOR_SHIFT,
    ) -> None:
        self.folded = Folded(partition, partitions)
        self.cursor_shift = cursor_shift
        """A position's cursors: `position << cursor_shift | place` (16: a NATS stream's; 0: a SQL store's)."""
        self.keep_releases = keep_releases
        self.track_sides = track_sides
        self.order: list[Key] = []
        """With `track_sides`: the sides in first-seen order (the service's transfer listing)."""
        self.first: list[int] = []
        """Each side's first event's cursor, in `order`'s order (ascending)."""
        self._seen: set[Key] = set()
        self.by_request: dict[str, tuple[tuple[int, Key], ...]] = {}
        """With `track_sides`: per request id, (cursor, key) of each side a map named it for, at the first such
        map (the one-process service's `by_request`, with the stream positions a merge orders by). Tuples, as
        the service's: a tuple of atomic values is one the collector leaves out of its passes."""
        self.applied = 0
        """The position (stream sequence, SQL cursor) of the last message folded (0: none)."""
        self.upto = 0
        """Every message of the partition at or below this position is folded."""
        self.mark: Mark | None = None
        """A SQL store's mark at `upto` (`kvledger.ledger.store.partition_source.Mark`), checked at a restore."""
        self.digest = 0
        """The sum, mod 2**64, of `crc32(source) << 32 | seq` over the events folded."""
        self.saved = 0
        """`applied` of the newest snapshot saved or restored."""
        self.restored = 0
        """`applied` of the snapshot this fold was restored from (0: folded from the stream's start)."""
        self.events_since_save = 0
        self._crc: dict[str, int] = {}
        self.last_ts: dict[str, float] = {}
        """Each source's newest event ts, as the one-process service keeps it (`kvledger.ledger.picture`)."""
        self.events_by_kind: dict[str, int] = dict.fromkeys(KINDS, 0)
        self.first_map: tuple[int, float] | None = None
        """(cursor, ts) of the partition's first `map` event."""
        self.holding_end_ts: float | None = None
        """The newest ts of its `map` events and of the events that released a side (the blocks-held series' end)."""

    @property
    def partition(self) -> int:
        return self.folded.partition

    def apply(self, delivered: Delivered) -> None:
        """Fold one delivery (its rows are new: the consumer passed over what was folded)."""
        # Paused, and what the fold grew kept out of the collector's passes (`kvledger.ledger.collector`), as
        # the service's fold does: else a pass now and then walked the whole fold, a tenth of a second or more
        # at a million events, in whichever of the worker's threads set it off (an answer's, as often).
        with collector_paused():
            self._apply(delivered)
            untrack(self.grown_containers())

    def grown_containers(self) -> list[object]:
        """The containers that grow with the fold, each of atomic values (`LedgerState.grown_containers`'s
        kind): the state's, the merge items' lists and the side listing's."""
        f = self.folded
        return [*f.state.grown_containers(), f.decided, f.frees, f.claims, f.expired, self.order, self.first,
                self._seen, self.by_request]  # fmt: skip

    def _apply(self, delivered: Delivered) -> None:
        rows = delivered.rows
        if rows:
            events: list[Event] = [e for _, e in rows]
            cursors = [c for c, _ in rows]
            part = (events, cursors, len(events), max(e.ts for e in events))
            freed = len(self.folded.frees)
            fold_partition(
                [part], self.folded.partition, self.folded.partitions, into=self.folded,
                keep_releases=self.keep_releases, compact_every=None,  # never: see the class docstring
            )  # fmt: skip
            if self.track_sides:
                seen, order, first = self._seen, self.order, self.first
                by_request = self.by_request
                for cursor, e in rows:
                    key = (e.source, e.transfer_id)
                    # The whole delivery is folded: a drop (which makes no side) before its side's first event
                    # would find the side made.
                    if key not in seen and type(e) is not Drop and key in self.folded.state.transfers:
                        seen.add(key)
                        order.append(key)
                        first.append(cursor)
                    if type(e) is Map:
                        named = by_request.get(e.request_id)
                        if named is None:
                            by_request[e.request_id] = ((cursor, key),)
                        elif all(k != key for _, k in named):
                            by_request[e.request_id] = (*named, (cursor, key))
            crc = self._crc
            digest = self.digest
            last_ts, by_kind = self.last_ts, self.events_by_kind
            end = self.holding_end_ts if self.holding_end_ts is not None else float("-inf")
            for e in events:
                c = crc.get(e.source)
                if c is None:
                    c = crc[e.source] = zlib.crc32(e.source.encode())
                digest += (c << 32) | e.seq
                kind = KIND_OF_TYPE[type(e)]
                by_kind[kind] += 1
                if e.ts > last_ts.get(e.source, 0.0):
                    last_ts[e.source] = e.ts
                if kind == "map" and e.ts > end:
                    end = e.ts
            for free in self.folded.frees[freed:]:  # each release's event, by its cursor
                released_ts = events[bisect_left(cursors, free.index)].ts
                if released_ts > end:
                    end = released_ts
            if end != float("-inf"):
                self.holding_end_ts = end
            if self.first_map is None:
                self.first_map = next(((c, e.ts) for c, e in rows if type(e) is Map), None)
            self.digest = digest & DIGEST_MASK
            self.events_since_save += len(events)
            self.applied = delivered.last_seq
        if delivered.mark is not None and delivered.upto >= self.upto:
            self.mark = delivered.mark
        self.upto = max(self.upto, delivered.upto, self.applied)

    def take(self) -> Batch:
        """What the fold told since the last `take` (releases' sides, accepted maps), complete up to `upto`."""
        return self.folded.take(through_cursor(self.upto, self.cursor_shift))

    def answer(
        self,
        now: float,
        config: AuditConfig | None = None,
        *,
        upto: int | None = None,
        since: int | None = None,
        picture: bool = False,
    ) -> PartitionAnswer:
        """The partition's answer at `now` (`kvledger.ledger.partitioned.answer`), its rest told up to stream
        sequence `upto` (default: its own; a merge of several answers needs one `upto` for all). Without
        `since`, its merge items are told once (taken from the fold). With `since` (a stream position), the
        fold keeps every item and the answer tells those after `since`: a merge that starts again (a service
        started again, a merge of split services from scratch: `since` 0) is told everything. With `picture`,
        the answer carries the partition's `Picture` (a service's page and metrics)."""
        f = self.folded
        if since is None:
            found = answer(f, now, config)
        else:
            kept = f.decided, f.frees, f.claims, f.expired
            f.decided = f.decided[bisect_right(f.decided, since, key=_index) :]
            f.frees = f.frees[bisect_right(f.frees, since, key=_index) :]
            f.claims = f.claims[bisect_right(f.claims, since, key=_index) :]
            f.expired = f.expired[bisect_right(f.expired, since, key=_first_of) :]
            try:
                found = answer(f, now, config)
            finally:
                f.decided, f.frees, f.claims, f.expired = kept
        found.rest.upto = through_cursor(self.upto if upto is None else upto, self.cursor_shift)
        if picture:
            found.picture = picture_of(
                f.state, found.findings, config, last_ts=self.last_ts, events_by_kind=self.events_by_kind,
                first_map=self.first_map, holding_end_ts=self.holding_end_ts,
            )  # fmt: skip
        return found

    def sides_after(self, cursor: int) -> Iterator[tuple[int, TransferState]]:
        """With `track_sides`: (first cursor, side) of the sides first seen after `cursor`, in that order."""
        transfers = self.folded.state.transfers
        order, first = self.order, self.first
        for i in range(bisect_right(first, cursor), len(order)):
            t = transfers.get(order[i])
            if t is not None:
                yield first[i], t

    def encode(self) -> bytes:
        f = self.folded
        pending = Batch(0, list(f.decided), list(f.frees), list(f.claims), list(f.expired))
        saved = _Saved(
            format=FORMAT, partition=f.partition, partitions=f.partitions, applied=self.applied, upto=self.upto,
            digest=self.digest, events=f.events, first_index=f.first_index, first_ts=f.first_ts,
            last_ts=f.last_ts, stream_events=f.stream_events, stream_last_ts=f.stream_last_ts,
            next_compaction=f.next_compaction, latencies=f.latencies.to_plain(), pending=pending,
            state=msgspec.Raw(snapshot.encode(f.state)), order=self.order, first=self.first, mark=self.mark,
            source_last_ts=self.last_ts, events_by_kind=self.events_by_kind, first_map=self.first_map,
            by_request=self.by_request, holding_end_ts=self.holding_end_ts,
        )  # fmt: skip
        return zlib.compress(_encode(saved), 1)

    @classmethod
    def decode(cls, body: bytes, **options: Any) -> PartitionFold:
        """A saved fold (`encode`); `options` as `PartitionFold`'s."""
        try:
            saved = _saved_decoder.decode(zlib.decompress(body))
        except (zlib.error, msgspec.DecodeError) as error:
            raise SnapshotFormatError(f"a partition snapshot does not decode: {error}") from None
        if saved.format != FORMAT:
            raise SnapshotFormatError(f"partition snapshot format {saved.format}, this build reads {FORMAT}")
        out = cls(saved.partition, saved.partitions, **options)
        f = out.folded
        f.state = snapshot.decode(saved.state)
        f.latencies = LatencyRecorder.from_plain(saved.latencies)
        f.decided, f.frees, f.claims = saved.pending.decided, saved.pending.frees, saved.pending.claims
        f.expired = saved.pending.expired
        f.events, f.first_index, f.first_ts, f.last_ts = saved.events, saved.first_index, saved.first_ts, saved.last_ts
        f.stream_events, f.stream_last_ts = saved.stream_events, saved.stream_last_ts
        f.next_compaction = saved.next_compaction
        out.applied = out.saved = out.restored = saved.applied
        out.upto, out.digest, out.mark = saved.upto, saved.digest, saved.mark
        out.last_ts, out.first_map = saved.source_last_ts, saved.first_map
        out.events_by_kind.update(saved.events_by_kind)
        out.holding_end_ts = saved.holding_end_ts
        if out.track_sides:
            out.order = saved.order
            out.first = saved.first
            out._seen = set(out.order)
            out.by_request = saved.by_request
        return out


def restore(store: EventStore, service: str, partition: int, partitions: int, **options: Any) -> PartitionFold:
    """The partition's newest saved fold, or a new one where none is saved (or the newest does not decode);
    `options` as `PartitionFold`'s."""
    stored = store.latest_snapshot(snapshot_source(service, partition, partitions, stream=is_stream(store)))
    if stored is not None and stored.format == FORMAT:
        try:
            return PartitionFold.decode(stored.body, **options)
        except SnapshotFormatError:
            pass  # folded again from the start: the source starts it again (`PartitionSource.reset`)
    return PartitionFold(partition, partitions, **options)


def save(store: EventStore, service: str, fold: PartitionFold, taken: tuple[int, bytes] | None = None) -> None:
    """Save `fold` (the newest snapshot of its partition; older ones are deleted): `taken`, (applied, body) of
    an `encode` made before (under the caller's lock), or encoded now."""
    f = fold.folded
    applied, body = taken if taken is not None else (fold.applied, fold.encode())
    source = snapshot_source(service, f.partition, f.partitions, stream=is_stream(store))
    store.save_snapshot(StoredSnapshot(source, applied, FORMAT, time.time(), body))
    store.delete_snapshots(source, applied)
    fold.saved = applied


OUTAGE_WAIT_S_MAX = 2.0
"""While the server does not answer, a worker asks again at most this far apart (doubling from its fetch's wait)."""


def open_source(store: EventStore, folds: dict[int, PartitionFold], service: str) -> PartitionSource:
    """The source `folds` go on from: a NATS stream's durable consumers (named by `service`), or a SQL
    store's tail from where they are."""
    if is_stream(store):
        from kvledger.ledger.store.nats_consumer import PartitionConsumers

        folded = {p: f.applied for p, f in folds.items()}
        return PartitionConsumers(store, list(folds), service=service, folded=folded)  # type: ignore[arg-type]
    from kvledger.ledger.store.partition_source import StoreTail

    held = {p: Held(f.upto, f.mark) for p, f in folds.items()}
    return StoreTail(store, partition_count(store), list(folds), held)


def run_worker(
    store: EventStore,
    partitions: Sequence[int],
    *,
    service: str,
    between: Callable[[dict[int, PartitionFold], list[Delivered]], bool],
    snapshot_every_s: float = FLEET_SNAPSHOT_EVERY_S,
    snapshot_every_events: int = FLEET_SNAPSHOT_EVERY_EVENTS,
    fetch_messages: int | None = None,
    fetch_timeout_s: float = 0.2,
    after_save: Callable[[PartitionFold], None] | None = None,
    lock: AbstractContextManager[object] | None = None,
    started: Callable[[dict[int, PartitionFold]], None] | None = None,
    **options: Any,
) -> dict[int, PartitionFold]:
    """Fold `partitions` of the store from its source (`open_source`) until `between` (called after every
    fetch with the folds and what the fetch brought) returns False; then save what is not saved and
    acknowledge it. `after_save` is called after each save, before its acknowledgement (tests crash there).
    Each delivery is folded, and each fold saved, holding `lock` (a service's worker answers requests from
    another thread under it); `started` is given the folds once restored; `options` as `PartitionFold`'s.
    While the server does not answer, fetches come back empty (and saves wait): the worker goes on once it
    answers again; what it had folded and not saved is acknowledged later, never lost."""
    guard = lock if lock is not None else nullcontext()
    count = partition_count(store)
    options.setdefault("cursor_shift", cursor_shift(store))
    folds = {p: restore(store, service, p, count, **options) for p in partitions}
    source = open_source(store, folds, service)
    for p in source.reset:
        stale = folds[p].applied
        folds[p] = PartitionFold(p, count, **options)
        if stale:  # the saved fold cannot be gone on from: it is not to be restored again
            store.delete_snapshots(snapshot_source(service, p, count, stream=is_stream(store)), stale + 1)
    if started is not None:
        started(folds)
    last_save = time.monotonic()
    saving: _Saving | None = None
    encode_cpu_s = 0.0  # the last child's encoding: saves come at most once per SNAPSHOT_COST_FACTOR times it

    def stored(fold: PartitionFold, taken: tuple[int, bytes]) -> None:
        save(store, service, fold, taken)
        if after_save is not None:
            after_save(fold)
        source.ack(fold.partition, fold.saved)

    def finish_saving(wait: bool) -> None:
        """Save and acknowledge what the forked child encoded, once it is done (or waiting for it)."""
        nonlocal saving, encode_cpu_s
        if saving is None or (not wait and not saving.done()):
            return
        for fold, taken in saving.taken():
            stored(fold, taken)
        encode_cpu_s = saving.cpu_s
        saving = None

    def start_saving() -> None:
        """Save every fold that folded something since its last save, from a forked child (`_Saving`, one at
        a time): the lock is held for the fork only, requests and folding go on while it encodes, and
        `finish_saving` saves and acknowledges once it is done."""
        nonlocal last_save, saving
        last_save = time.monotonic()
        finish_saving(wait=False)
        due = [fold for fold in folds.values() if fold.applied > fold.saved]
        if saving is None and due:
            with guard:
                saving = _Saving(due)
                for fold in due:
                    fold.events_since_save = 0

    def save_all() -> None:
        """The worker stops: the child's saves, then every fold not saved since, each encoded now under the
        lock, and the acknowledgement of what was delivered again and passed over."""
        finish_saving(wait=True)
        for fold in folds.values():
            if fold.applied > fold.saved:
                with guard:
                    taken = (fold.applied, fold.encode())
                    fold.events_since_save = 0
                stored(fold, taken)
            elif fold.saved:
                source.ack(fold.partition, fold.saved)

    waited = 0.0
    try:
        while True:
            try:
                delivered = source.fetch(fetch_messages, fetch_timeout_s)
                waited = 0.0
            except StoreUnavailable:  # the server is away: the connection comes back by itself; so do we
                delivered = []
                waited = min(OUTAGE_WAIT_S_MAX, max(fetch_timeout_s, 2 * waited))
                time.sleep(waited)
            with guard:
                for d in delivered:
                    folds[d.partition].apply(d)
            if not between(folds, delivered):
                break
            with contextlib.suppress(StoreUnavailable):  # not saved, not acknowledged: tried again later
                finish_saving(wait=False)
            folded = sum(f.events_since_save for f in folds.values())
            since_save = time.monotonic() - last_save
            # Behind (a start over a large store), saves go by events alone: each encodes the whole fold, and
            # a million events' fold takes about 4 CPU seconds: not once every `snapshot_every_s` of a long start.
            if (
                folded
                and since_save >= SNAPSHOT_COST_FACTOR * encode_cpu_s
                and (folded >= snapshot_every_events or (not source.behind and since_save >= snapshot_every_s))
            ):
                with contextlib.suppress(StoreUnavailable):  # not saved, not acknowledged: tried again later
                    start_saving()
        save_all()
    finally:
        if saving is not None:
            saving.abandon()
        source.close()
    return folds


_bodies = msgspec.msgpack.Decoder(list[bytes])


class _Saving:
    """Folds being encoded in a forked child (`kvledger.ledger.forked`), made under the worker's lock: each
    fold's `applied` as of the fork, the bodies read on a thread of their own."""

    def __init__(self, folds: list[PartitionFold]) -> None:
        self.folds = folds
        self.applied = [fold.applied for fold in folds]
        self.child = fork_making(lambda: _encode([fold.encode() for fold in folds]))
        self._bodies: list[bytes] | None = None
        self.cpu_s = 0.0
        """The CPU seconds the child took, once done."""
        self._thread = threading.Thread(target=self._read, name="kvledger-worker-snapshot", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            body, self.cpu_s = self.child.result()
            self._bodies = _bodies.decode(body)
        except BaseException as error:  # the child failed (or was ended): its folds are saved again later
            logging.getLogger(__name__).warning("kvledger worker: snapshot of partitions %s not made: %s",
                                                [f.partition for f in self.folds], error)  # fmt: skip
            for fold in self.folds:
                fold.events_since_save = max(fold.events_since_save, 1)

    def done(self) -> bool:
        return not self._thread.is_alive()

    def taken(self) -> list[tuple[PartitionFold, tuple[int, bytes]]]:
        """(fold, (applied, body)) of each fold, once done (waits for it); none where the child failed."""
        self._thread.join()
        if self._bodies is None:
            return []
        return [(f, (a, b)) for f, a, b in zip(self.folds, self.applied, self._bodies, strict=True)]

    def abandon(self) -> None:
        """The worker is leaving before the saves were made: end the child."""
        self.child.kill()
        self._thread.join()


TOLD_ALL = 1 << 62
"""A stream position past any cursor: what a partition no worker of this service folds has told."""


class LiveMerge:
    """A service's merge of its partitions' answers, asked again and again (`kvledger.api.fleet`): each
    answer's merge items (`PartitionAnswer.rest`) are fed to one `Merger` once, by stream position, so the
    per-source block ownership goes on from where the last answer left it. An item at or below what its
    partition told before is passed over: an answer that tells everything again (`PartitionFold.answer`
    with `since`), or a worker started again that folds again what it had told (its fold is the same, event
    for event: the same items at the same positions). Partitions not in `owned` count as empty.

    `add` gives the findings of one fold of what the partitions have folded: theirs (at the answers' `now`)
    and `double_owner` judged as of the least position every partition has told (`Merger.merged_upto`); the
    two agree once every partition has folded the stream to its end."""

    def __init__(self, partitions: int, owned: Sequence[int]) -> None:
        self.merger = Merger(partitions)
        self.told = [0] * partitions
        for p in set(range(partitions)) - set(owned):
            self.merger.add(p, Batch(TOLD_ALL, [], [], [], []))
            self.told[p] = TOLD_ALL

    def add(self, answers: Sequence[PartitionAnswer]) -> tuple[list[Finding], int]:
        """Feed `answers` (one per owned partition, at one `now`); (merged findings, events folded)."""
        self.feed(answers)
        return self.findings(answers)

    def feed(self, answers: Sequence[PartitionAnswer]) -> None:
        """The merge items of `answers` not told before, fed to the merger (`add`'s first half: the work the
        stream's maps and releases make, however often the answers come)."""
        for a in answers:
            told = self.told[a.partition]
            rest = a.rest
            batch = Batch(
                max(rest.upto, told),
                [d for d in rest.decided if d.index > told],
                [f for f in rest.frees if f.index > told],
                [c for c in rest.claims if c.index > told],
                [pair for pair in rest.expired if pair[0] > told],
            )
            self.merger.add(a.partition, batch)
            self.told[a.partition] = batch.upto

    def findings(self, answers: Sequence[PartitionAnswer]) -> tuple[list[Finding], int]:
        """(merged findings, events folded) of `answers`, once `feed` has had them (`add`'s second half)."""
        findings = [f for a in answers for f in a.findings]
        findings.extend(self.merger.ownership.findings())
        findings.sort(key=finding_order)
        return findings, sum(a.events for a in answers)


# -- a service's worker process ----------------------------------------------------------------------------

_request_decoder = msgspec.msgpack.Decoder(list[Any])


class SidesAsked(msgspec.Struct, array_like=True):
    """A page of the transfer listing asked of a worker: its sides first seen after `cursor`, filtered."""

    cursor: int
    limit: int
    phase: str | None
    source: str | None
    mode: str | None
    request_id: str | None
    flagged: list[tuple[str, TransferId]] | None
    """With `has_finding`: the sides (of this worker's partitions) that have a finding."""
    has_finding: bool | None
    scan_max: int


def _sides(folds: dict[int, PartitionFold], asked: SidesAsked) -> tuple[list[tuple[int, TransferState]], int | None]:
    """The matching sides of `folds` first seen after `asked.cursor`, by first cursor, and the cursor they are
    complete through: every match at or below it is in the list, none above (None: every match is, to the
    end). At most `asked.limit` matches, and `asked.scan_max` sides looked at per fold."""
    flagged = set(asked.flagged) if asked.flagged is not None else None
    found: list[tuple[int, TransferState]] = []
    through: int | None = None
    for fold in folds.values():  # each fold's sides come in first-cursor order
        matched = scanned = 0
        for first, t in fold.sides_after(asked.cursor):
            if through is not None and first > through:
                break  # past what another fold's page reached
            scanned += 1
            if scanned > asked.scan_max:
                through = first - 1 if through is None else min(through, first - 1)
                break
            if (
                (asked.phase is not None and t.phase != asked.phase)
                or (asked.source is not None and t.source != asked.source)
                or (asked.mode is not None and t.mode != asked.mode)
                or (asked.request_id is not None and t.request_id != asked.request_id)
                or (flagged is not None and ((t.source, t.transfer_id) in flagged) != asked.has_finding)
            ):
                continue
            found.append((first, t))
            matched += 1
            if matched >= asked.limit:
                through = first if through is None else min(through, first)
                break
    found.sort(key=_first_of)
    if through is not None:
        found = [pair for pair in found if pair[0] <= through]
    if len(found) > asked.limit:
        del found[asked.limit :]
        through = found[-1][0]
    return found, through


def merge_pages(
    pages: Sequence[tuple[list[tuple[int, TransferState]], int | None]], limit: int
) -> tuple[list[TransferState], int | None]:
    """Several workers' pages of sides (`_sides`) as one: up to `limit` sides in first-cursor order, and the
    cursor the next page starts after (None: the end). Every worker's matches up to the least cursor any page
    is complete through are there; none beyond it is kept."""
    reached = [through for _, through in pages if through is not None]
    bound = min(reached) if reached else None
    found = sorted((pair for page, _ in pages for pair in page if bound is None or pair[0] <= bound), key=_first_of)
    if len(found) > limit:
        del found[limit:]
        bound = found[-1][0]
    return [t for _, t in found], bound


def _request_sides(folds: dict[int, PartitionFold], request_id: str) -> tuple[bool, list[tuple[int, TransferState]]]:
    """Whether a map in `folds` named `request_id`, and (cursor, side) of the sides it was named for that
    `folds` hold, by the cursor of the first map naming each: a worker's part of `/requests/{id}`."""
    named = False
    found: list[tuple[int, TransferState]] = []
    for fold in folds.values():
        keys = fold.by_request.get(request_id)
        if keys:
            named = True
            transfers = fold.folded.state.transfers
            found += [(cursor, t) for cursor, key in keys if (t := transfers.get(key)) is not None]
    found.sort(key=_first_of)
    return named, found


def _found(folds: dict[int, PartitionFold], findings: list[Finding], config: AuditConfig) -> list[float]:
    """When each of `findings` (of sides in `folds`) became true (`kvledger.ledger.audit.found_at`): what a
    service asks of the worker folding a `double_owner` finding's side, the merge having judged it."""
    out: list[float] = []
    for f in findings:
        fold = next((fold for fold in folds.values() if (f.source, f.transfer_id) in fold.folded.state.transfers), None)
        out.append(found_at(f, fold.folded.state, config) if fold is not None else 0.0)
    return out


def merge_request_sides(parts: Sequence[tuple[bool, list[tuple[int, TransferState]]]]) -> list[TransferState] | None:
    """Several workers' `_request_sides` as the one-process service's `/requests/{id}`: the sides in the order
    maps first named them (None: no map named the request)."""
    if not any(named for named, _ in parts):
        return None
    return [t for _, t in sorted((pair for _, found in parts for pair in found), key=_first_of)]


def serve_worker(conn: Any, url: str, partitions: list[int], service: str, fetch_timeout_s: float) -> None:
    """A service's partition worker (a process of its own, `kvledger serve --partitions`): folds `partitions`
    from their source (`open_source`), every side and every merge item kept (as the one-process service keeps
    every side), and answers the service on `conn` (a `multiprocessing` connection) between two
    deliveries. Messages are msgpack arrays: requests `[kind, id, ...]`, replies `[kind, id, payload]` with
    the payload encoded apart (`kvledger.api.fleet` decodes them):

    - `["answer", id, now, transfer_timeout_s, clock_skew_s, since]`: each partition's `PartitionAnswer` at
      `now`, telling its merge items after `since[partition]` (the worker keeps every one: a merge that starts
      again is told everything),
      with the CPU seconds they took: `(seconds, [PartitionAnswer, ...])`;
    - `["sides", id, SidesAsked]`: `(first cursor, TransferState)` pairs and the cursor they are complete
      through (None: to the end);
    - `["transfer", id, transfer_id]`: the sides of one transfer id;
    - `["request", id, request_id]`: whether a map named the request id, and (cursor, side) of its sides;
    - `["found", id, [Finding, ...], transfer_timeout_s, clock_skew_s]`: when each became true (`_found`);
    - `["status", id]`: per partition, events folded, `upto`, `applied` and `restored`;
    - `["stop"]` (or the service gone): save, acknowledge, exit.
    `["ready", 0, partitions]` is sent once the folds are restored."""
    import threading

    from kvledger.ledger.store.connect import open_store

    store = open_store(url)
    lock = threading.Lock()
    sending = threading.Lock()
    stop = threading.Event()

    def send(kind: str, rid: int, payload: bytes) -> None:
        with sending:
            conn.send_bytes(_encode([kind, rid, payload]))

    def serve_requests(folds: dict[int, PartitionFold]) -> None:
        while not stop.is_set():
            try:
                request = _request_decoder.decode(conn.recv_bytes())
            except (EOFError, OSError):
                break
            kind = request[0]
            if kind == "stop":
                break
            rid = int(request[1])
            with lock:
                if kind == "answer":
                    config = AuditConfig(float(request[3]), float(request[4]))
                    since = {int(p): int(c) for p, c in request[5].items()}
                    began = time.thread_time()  # CPU: another process on the core is not this cost
                    answers = [
                        f.answer(float(request[2]), config, since=since.get(p, 0), picture=True)
                        for p, f in folds.items()
                    ]
                    payload = _encode((time.thread_time() - began, answers))
                elif kind == "sides":
                    asked = msgspec.convert(request[2], SidesAsked)
                    payload = _encode(_sides(folds, asked))
                elif kind == "transfer":
                    tid = TransferId(str(request[2]))
                    sides = [
                        t for f in folds.values() for s in f.folded.state.sources
                        if (t := f.folded.state.transfers.get((s, tid))) is not None
                    ]  # fmt: skip
                    payload = _encode(sides)
                elif kind == "found":
                    config = AuditConfig(float(request[3]), float(request[4]))
                    judged = msgspec.convert(request[2], list[Finding])
                    payload = _encode(_found(folds, judged, config))
                elif kind == "request":
                    payload = _encode(_request_sides(folds, str(request[2])))
                else:
                    payload = _encode({p: (f.folded.events, f.upto, f.applied, f.restored) for p, f in folds.items()})
            send(kind, rid, payload)
        stop.set()

    def started(folds: dict[int, PartitionFold]) -> None:
        for fold in folds.values():
            untrack(fold.grown_containers())  # the restored folds: as `apply` leaves what it grew
        gc.freeze()  # the modules and the restored folds: never walked again (the one-process service's rule)
        threading.Thread(target=serve_requests, args=(folds,), name="kvledger-worker-requests", daemon=True).start()
        send("ready", 0, _encode(sorted(folds)))

    try:
        run_worker(
            store, partitions, service=service, between=lambda folds, delivered: not stop.is_set(), lock=lock,
            started=started, fetch_timeout_s=fetch_timeout_s, track_sides=True,
        )  # fmt: skip
    finally:
        store.close()
