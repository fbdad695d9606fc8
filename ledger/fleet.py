"""A partition worker: some partitions of a NATS stream, each folded from its durable consumer, saved and
acknowledged so that a worker started after a crash goes on where the last saved fold was.

Each owned partition is a `PartitionFold`: `kvledger.ledger.partitioned.Folded` fed the consumer's
deliveries (`kvledger.ledger.store.nats_consumer.Delivered`) as they come, each event's position in the
whole stream being its store cursor (cursors grow with the stream's sequence, so the merge's index order
is the stream's order: `Merger` and `answer` take them as they take a log's line positions). A partition's
fold never waits on another's.

Exactly once. A message is acknowledged only once a saved snapshot of the partition's fold holds it: the
worker saves (`save`: the fold and the stream sequence it holds, in the stream's object store under
`snapshot_source`) every `FLEET_SNAPSHOT_EVERY_S` seconds or `FLEET_SNAPSHOT_EVERY_EVENTS` events while
it folds, and when it stops, and then acknowledges through the saved sequence. A worker started again
restores the newest snapshot (`restore`) and binds to the same durable consumers: what was acknowledged
is in the snapshot; what came after is delivered again, and a message the snapshot holds already (a crash
between a save and its acknowledgement) is recognised by its stream sequence, one stored batch of one
source's seqs, and passed over. `digest` adds up every folded event's (source, seq) (its crc32 and seq)
so a test can see that each was folded once.

The fold itself is sans-IO; `run_worker` is the loop around the consumer and the store.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import msgspec

from kvledger.ledger.advice import LatencyRecorder, RecorderPlain
from kvledger.ledger.audit import AuditConfig
from kvledger.ledger.events import Event
from kvledger.ledger.limits import FLEET_SNAPSHOT_EVERY_EVENTS, FLEET_SNAPSHOT_EVERY_S, REPLAY_COMPACT_EVERY
from kvledger.ledger.partitioned import Batch, Folded, PartitionAnswer, answer, fold_partition
from kvledger.ledger.store import snapshot
from kvledger.ledger.store.base import StoredSnapshot
from kvledger.ledger.store.snapshot import SnapshotFormatError

if TYPE_CHECKING:
    from kvledger.ledger.store.nats_consumer import Delivered
    from kvledger.ledger.store.nats_store import NatsStore

FORMAT = 1
CURSOR_SHIFT = 16
"""As the NATS store's cursors: `stream seq << 16 | place`."""
PLACES = (1 << CURSOR_SHIFT) - 1
DIGEST_MASK = (1 << 64) - 1


def through_cursor(stream_seq: int) -> int:
    """The highest cursor of the message at `stream_seq`: every event of it and of earlier messages is below."""
    return (stream_seq << CURSOR_SHIFT) | PLACES


def snapshot_source(service: str, partition: int, partitions: int) -> str:
    """The name a partition's snapshots are kept under in the store (starts with NUL: no event's source can)."""
    return f"\x00fleet:{service}:{partition}/{partitions}"


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


_saved_decoder = msgspec.msgpack.Decoder(_Saved)
_encode = msgspec.msgpack.Encoder().encode


class PartitionFold:
    """One partition's fold from its consumer, and where in the stream it is."""

    def __init__(self, partition: int, partitions: int, *, keep_releases: bool = False) -> None:
        self.folded = Folded(partition, partitions)
        self.keep_releases = keep_releases
        self.applied = 0
        """The stream sequence of the last message folded (0: none)."""
        self.upto = 0
        """Every message of the partition at or below this stream sequence is folded."""
        self.digest = 0
        """The sum, mod 2**64, of `crc32(source) << 32 | seq` over the events folded."""
        self.saved = 0
        """`applied` of the newest snapshot saved or restored."""
        self.events_since_save = 0
        self._crc: dict[str, int] = {}

    @property
    def partition(self) -> int:
        return self.folded.partition

    def apply(self, delivered: Delivered) -> None:
        """Fold one delivery (its rows are new: the consumer passed over what was folded)."""
        rows = delivered.rows
        if rows:
            events: list[Event] = [e for _, e in rows]
            cursors = [c for c, _ in rows]
            part = (events, cursors, len(events), max(e.ts for e in events))
            fold_partition(
                [part], self.folded.partition, self.folded.partitions, into=self.folded,
                keep_releases=self.keep_releases, compact_every=REPLAY_COMPACT_EVERY,
            )  # fmt: skip
            crc = self._crc
            digest = self.digest
            for e in events:
                c = crc.get(e.source)
                if c is None:
                    c = crc[e.source] = zlib.crc32(e.source.encode())
                digest += (c << 32) | e.seq
            self.digest = digest & DIGEST_MASK
            self.events_since_save += len(events)
            self.applied = delivered.last_seq
        self.upto = max(self.upto, delivered.upto, self.applied)

    def take(self) -> Batch:
        """What the fold told since the last `take` (releases' sides, accepted maps), complete up to `upto`."""
        return self.folded.take(through_cursor(self.upto))

    def answer(self, now: float, config: AuditConfig | None = None, *, upto: int | None = None) -> PartitionAnswer:
        """The partition's answer at `now` (`kvledger.ledger.partitioned.answer`), its rest told up to stream
        sequence `upto` (default: its own; a merge of several answers needs one `upto` for all)."""
        found = answer(self.folded, now, config)
        found.rest.upto = through_cursor(self.upto if upto is None else upto)
        return found

    def encode(self) -> bytes:
        f = self.folded
        pending = Batch(0, list(f.decided), list(f.frees), list(f.claims), list(f.expired))
        saved = _Saved(
            format=FORMAT, partition=f.partition, partitions=f.partitions, applied=self.applied, upto=self.upto,
            digest=self.digest, events=f.events, first_index=f.first_index, first_ts=f.first_ts,
            last_ts=f.last_ts, stream_events=f.stream_events, stream_last_ts=f.stream_last_ts,
            next_compaction=f.next_compaction, latencies=f.latencies.to_plain(), pending=pending,
            state=msgspec.Raw(snapshot.encode(f.state)),
        )  # fmt: skip
        return zlib.compress(_encode(saved), 1)

    @classmethod
    def decode(cls, body: bytes, *, keep_releases: bool = False) -> PartitionFold:
        try:
            saved = _saved_decoder.decode(zlib.decompress(body))
        except (zlib.error, msgspec.DecodeError) as error:
            raise SnapshotFormatError(f"a partition snapshot does not decode: {error}") from None
        if saved.format != FORMAT:
            raise SnapshotFormatError(f"partition snapshot format {saved.format}, this build reads {FORMAT}")
        out = cls(saved.partition, saved.partitions, keep_releases=keep_releases)
        f = out.folded
        f.state = snapshot.decode(saved.state)
        f.latencies = LatencyRecorder.from_plain(saved.latencies)
        f.decided, f.frees, f.claims = saved.pending.decided, saved.pending.frees, saved.pending.claims
        f.expired = saved.pending.expired
        f.events, f.first_index, f.first_ts, f.last_ts = saved.events, saved.first_index, saved.first_ts, saved.last_ts
        f.stream_events, f.stream_last_ts = saved.stream_events, saved.stream_last_ts
        f.next_compaction = saved.next_compaction
        out.applied = out.saved = saved.applied
        out.upto, out.digest = saved.upto, saved.digest
        return out


def restore(
    store: NatsStore, service: str, partition: int, partitions: int, *, keep_releases: bool = False
) -> PartitionFold:
    """The partition's newest saved fold, or a new one where none is saved (or the newest does not decode)."""
    stored = store.latest_snapshot(snapshot_source(service, partition, partitions))
    if stored is not None and stored.format == FORMAT:
        try:
            return PartitionFold.decode(stored.body, keep_releases=keep_releases)
        except SnapshotFormatError:
            pass  # folded again from the start: the consumer is made again for it (`PartitionConsumers`)
    return PartitionFold(partition, partitions, keep_releases=keep_releases)


def save(store: NatsStore, service: str, fold: PartitionFold) -> None:
    """Save `fold` (the newest snapshot of its partition; older ones are deleted)."""
    f = fold.folded
    source = snapshot_source(service, f.partition, f.partitions)
    store.save_snapshot(StoredSnapshot(source, fold.applied, FORMAT, time.time(), fold.encode()))
    store.delete_snapshots(source, fold.applied)
    fold.saved = fold.applied
    fold.events_since_save = 0


def run_worker(
    store: NatsStore,
    partitions: Sequence[int],
    *,
    service: str,
    between: Callable[[dict[int, PartitionFold], list[Delivered]], bool],
    keep_releases: bool = False,
    snapshot_every_s: float = FLEET_SNAPSHOT_EVERY_S,
    snapshot_every_events: int = FLEET_SNAPSHOT_EVERY_EVENTS,
    fetch_messages: int | None = None,
    fetch_timeout_s: float = 0.2,
    after_save: Callable[[PartitionFold], None] | None = None,
) -> dict[int, PartitionFold]:
    """Fold `partitions` of the stream from their durable consumers until `between` (called after every
    fetch with the folds and what the fetch brought) returns False; then save what is not saved and
    acknowledge it. `after_save` is called after each save, before its acknowledgement (tests crash there)."""
    from kvledger.ledger.store.nats_consumer import FETCH_MESSAGES, PartitionConsumers

    folds = {p: restore(store, service, p, store.partitions, keep_releases=keep_releases) for p in partitions}
    consumers = PartitionConsumers(store, list(folds), service=service, folded={p: f.applied for p, f in folds.items()})
    for p in consumers.reset:
        folds[p] = PartitionFold(p, store.partitions, keep_releases=keep_releases)
    last_save = time.monotonic()

    def save_due(force: bool) -> None:
        nonlocal last_save
        for fold in folds.values():
            if fold.applied > fold.saved:
                save(store, service, fold)
                if after_save is not None:
                    after_save(fold)
                consumers.ack(fold.partition, fold.saved)
            elif force and fold.saved:
                consumers.ack(fold.partition, fold.saved)  # what was delivered again and passed over
        last_save = time.monotonic()

    try:
        while True:
            delivered = consumers.fetch(fetch_messages or FETCH_MESSAGES, fetch_timeout_s)
            for d in delivered:
                folds[d.partition].apply(d)
            if not between(folds, delivered):
                break
            folded = sum(f.events_since_save for f in folds.values())
            if folded and (folded >= snapshot_every_events or time.monotonic() - last_save >= snapshot_every_s):
                save_due(False)
        save_due(True)
    finally:
        consumers.close()
    return folds
