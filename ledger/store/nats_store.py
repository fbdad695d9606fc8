"""The NATS JetStream store: the store contract (`base.EventStore`) over a stream; nats-py stays in here.

A message is a batch of one source's events of one partition (`nats_stream.py` names the subjects and the
stream's settings); its headers carry the source and its first and last seq, and `Nats-Msg-Id` is
`kvl:<source token>:<first seq>:<last seq>`, so a batch published again within the duplicate window is
stored once. Beyond the window, `append` is still idempotent by (source, seq): it knows each source's
highest stored seq (the last message of each of the source's subjects, read once and after any failure)
and, when a batch reaches at or below it, reads that source's stored events to skip the ones stored
(same content) or refuse the batch (`ConflictError`, different content) before publishing anything.
One process writes a source (an engine rank's writer), as for every store.

An append publishes all of its messages at once (`publish_async`: every acknowledgement in flight
together) and waits for their acknowledgements; a failure (the server down, an ack lost) raises
`StoreUnavailable`, and the writer retries or spills the batch: the messages that did land are
recognised on the retry, by their Msg-Id or by seq.

Order: events of one (partition, source) keep their batch order; a batch is stored one (partition, source)
group after another, groups in the order of their first event. A store-wide cursor is the message's
stream sequence times 2**16 plus the event's place in it (1-based): cursors grow with insertion order,
with gaps. `count` and `count_through` read message headers only (the stream keeps no event count).

The store's id (`store_id`) is the stream's name and the time the server made it, as the stream's own
information reports it: nothing to write, every stream has one (whichever kvledger made it), and a stream
deleted and made again under the same name is another store, whose snapshots are not the old one's.

Snapshots go to the object store `<stream>-snapshots` (one object per (source, seq)), refused events to
the stream `<stream>-quarantine`. Calls run on a private event loop thread, so every method is a plain
blocking call with a timeout, like the SQL stores'.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import json
import math
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Generator, Iterator, Sequence
from operator import attrgetter, itemgetter
from typing import NamedTuple, TypeVar

import msgspec
import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api
from nats.js.object_store import ObjectStore

from kvledger.ledger.events import Event, TransferId, to_msgpack
from kvledger.ledger.partition import partition_of, partition_of_event, rising_groups
from kvledger.ledger.store.base import (
    Appended,
    ConflictError,
    Quarantined,
    StoredSnapshot,
    StoreError,
    StoreUnavailable,
)
from kvledger.ledger.store.limits import NATS_WRITER_BATCH_AGE_S_MAX, QUARANTINE_READ_MAX, TAIL_EVENTS_MAX
from kvledger.ledger.store.nats_stream import CURSOR_SHIFT, PARTITIONS_DEFAULT, NatsTarget, source_token
from kvledger.ledger.store.rows import encode_rows, quarantine_row
from kvledger.ledger.valid import events_fit

T = TypeVar("T")

MESSAGE_EVENTS_MAX = 1_000
"""Events in one message at most (about 150 KB of msgpack; the server's default max_payload is 1 MB)."""
CALL_TIMEOUT_S = 5.0
"""How long one store call may wait for the server before it fails (the writer then spills and retries)."""
SCAN_FETCH_MESSAGES = 256
SCAN_EVENTS_PER_MESSAGE_GUESS = 100
"""Events a message holds, guessed before a scan has seen any (a writer's batch over the partitions and sources)."""
DESCRIPTION = "kvledger event log, partitions="
"""The stream's description names its partition count (nats-py cannot set stream metadata)."""

H_SOURCE, H_FIRST, H_LAST, H_COUNT = "Kvl-Source", "Kvl-First", "Kvl-Last", "Kvl-Count"
MSG_ID = "Nats-Msg-Id"

_events_decoder: msgspec.msgpack.Decoder[list[Event]] = msgspec.msgpack.Decoder(list[Event])
_encoder = msgspec.msgpack.Encoder()
_source, _seq = attrgetter("source"), attrgetter("seq")


def msg_id(source: str, first: int, last: int) -> str:
    """The de-duplication id of a batch of `source`'s events `first`..`last` (one partition's)."""
    return f"kvl:{source_token(source)}:{first}:{last}"


def with_cursors(seq: int, events: list[Event]) -> list[tuple[int, Event]]:
    """The events of the message at stream sequence `seq`, each with its cursor (`CURSOR_SHIFT`)."""
    base = seq << CURSOR_SHIFT
    return [(base | place, event) for place, event in enumerate(events, 1)]


def decode_batch(data: bytes) -> list[Event]:
    """The events of one message, in order."""
    return _events_decoder.decode(data)


def _snapshot_name(source: str, seq: int) -> str:
    return f"{source.encode().hex()}.{seq:020d}"


async def _next_messages(scan: AsyncIterator[Msg], most: int) -> list[Msg]:
    """The next `most` messages of `scan` (fewer: it has ended)."""
    out: list[Msg] = []
    async for msg in scan:
        out.append(msg)
        if len(out) >= most:
            break
    return out


class _Published(NamedTuple):
    """An append's acknowledgements, its messages' sizes, and what each held (kept for `append_returning` only)."""

    acks: list[api.PubAck]
    sizes: list[int]
    messages: list[list[Event]]
    stored_max: dict[str, int]

    @property
    def stored(self) -> int:
        """Events newly stored (a message the server took as a duplicate was stored by an earlier attempt)."""
        return sum(n for ack, n in zip(self.acks, self.sizes, strict=True) if not ack.duplicate)

    def appended(self) -> Appended:
        inserted: list[tuple[int, Event]] = []
        for ack, members in zip(self.acks, self.messages, strict=True):
            if not ack.duplicate:
                inserted.extend(with_cursors(ack.seq, members))
        inserted.sort(key=itemgetter(0))
        after = (min(ack.seq for ack in self.acks) - 1) << CURSOR_SHIFT | ((1 << CURSOR_SHIFT) - 1) if self.acks else 0
        return Appended(inserted, after, self.stored_max)


class NatsStore:
    """The event log in a JetStream stream (see the module docstring)."""

    writer_batch_age_s_max = NATS_WRITER_BATCH_AGE_S_MAX
    """A writer's batches to a stream wait longer than to a SQL store: each is split into a message per
    (partition, source), and a message's cost is most of what a fleet spends (see the constant)."""

    def __init__(self, target: NatsTarget, *, create: bool) -> None:
        self.target = target
        self.url = target.display
        self.partitions = target.partitions or PARTITIONS_DEFAULT
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvledger-nats", daemon=True)
        self._thread.start()
        self._closed = False
        self._stored_max: dict[str, int] = {}
        """Each source's highest stored seq (0: none), as last read or published; dropped after a failure."""
        self._nc: Client | None = None
        self._js: JetStreamContext | None = None
        self._objects: ObjectStore | None = None
        self._id = ""
        try:
            self._call(self._open(create), timeout=target.connect_timeout_s + CALL_TIMEOUT_S)
        except BaseException:
            self.close()
            raise

    # -- plumbing -------------------------------------------------------------

    def _call(self, coro: Awaitable[T], timeout: float = CALL_TIMEOUT_S) -> T:
        if self._closed:
            if asyncio.iscoroutine(coro):
                coro.close()
            raise StoreError(f"{self.url}: store is closed")
        future = asyncio.run_coroutine_threadsafe(self._guarded(coro), self._loop)
        try:
            return future.result(timeout + 1.0)
        except TimeoutError:
            future.cancel()
            raise StoreUnavailable(f"{self.url}: store unavailable: no answer in {timeout:.0f} s") from None

    async def _guarded(self, coro: Awaitable[T]) -> T:
        try:
            return await coro
        except StoreError:
            raise
        except (TimeoutError, nats.errors.Error, OSError) as error:
            raise StoreUnavailable(f"{self.url}: store unavailable: {type(error).__name__}: {error}") from error

    @property
    def js(self) -> JetStreamContext:
        assert self._js is not None
        return self._js

    async def _open(self, create: bool) -> None:
        try:
            self._nc = await nats.connect(
                self.target.servers,
                connect_timeout=self.target.connect_timeout_s,
                allow_reconnect=True,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.25,
            )
        except Exception as error:  # nats-py raises several kinds on a refused connection
            raise StoreUnavailable(f"{self.url}: store unavailable: cannot connect ({error})") from error
        self._js = self._nc.jetstream(timeout=CALL_TIMEOUT_S)
        try:
            info = await self.js.stream_info(self.target.stream)
        except nats.js.errors.NotFoundError:
            if not create:
                raise StoreUnavailable(
                    f"{self.url}: no stream {self.target.stream!r}; create it with "
                    f"`kvledger db upgrade --db {self.url}`"
                ) from None
            info = await self.js.add_stream(self._stream_config())
        described = info.config.description or ""
        found = described[len(DESCRIPTION) :] if described.startswith(DESCRIPTION) else None
        if found is None or not found.isdigit():
            raise StoreUnavailable(f"{self.url}: stream {self.target.stream!r} was not made by kvledger")
        if self.target.partitions is not None and int(found) != self.target.partitions:
            raise StoreUnavailable(
                f"{self.url}: the stream has {found} partitions, the URL asks for {self.target.partitions}; "
                "a stream's partition count cannot change (a transfer would move between workers)"
            )
        self.partitions = int(found)
        if info.created is None:
            raise StoreUnavailable(f"{self.url}: the server does not say when stream {self.target.stream!r} was made")
        self._id = f"{self.target.stream}@{info.created.isoformat()}"
        await self._ensure_side_stores(create)

    def _stream_config(self) -> api.StreamConfig:
        t = self.target
        return api.StreamConfig(
            name=t.stream,
            subjects=[t.subjects],
            retention=api.RetentionPolicy.LIMITS,
            discard=api.DiscardPolicy.NEW,  # a full stream refuses new batches: old events are never dropped
            storage=api.StorageType.FILE,
            num_replicas=t.replicas,
            duplicate_window=t.dup_window_s,
            max_bytes=t.max_bytes,
            max_msgs=t.max_msgs,
            max_age=0,
            allow_direct=True,
            description=f"{DESCRIPTION}{self.partitions}",
        )

    async def _ensure_side_stores(self, create: bool) -> None:
        t = self.target
        try:
            await self.js.stream_info(t.quarantine_stream)
        except nats.js.errors.NotFoundError:
            await self.js.add_stream(
                name=t.quarantine_stream,
                subjects=[t.quarantine_subject],
                storage=api.StorageType.FILE,
                num_replicas=t.replicas,
                discard=api.DiscardPolicy.NEW,
            )
        try:
            self._objects = await self.js.object_store(t.snapshot_bucket)
        except nats.js.errors.BucketNotFoundError:
            self._objects = await self.js.create_object_store(
                t.snapshot_bucket, api.ObjectStoreConfig(storage=api.StorageType.FILE, replicas=t.replicas)
            )

    async def _scan(
        self,
        subject: str,
        *,
        stream: str | None = None,
        start_seq: int = 0,
        headers_only: bool = False,
        events_wanted: int | None = None,
    ) -> AsyncGenerator[Msg, None]:
        """Every message of `subject` from `start_seq` (0: the first) to its last one when the scan began.
        With `events_wanted` (a caller that stops once its messages hold that many events), each fetch asks
        for about as many messages as those events still need, by the messages' event counts so far: a tail
        of a thousand events fetched 256 messages (tens of thousands of events) to use a few.

        The scan ends at the last message of `subject` (asked first), not where the messages' `num_pending`
        says: that count was seen one too high (a fetch then waited CALL_TIMEOUT_S for a message the stream
        did not hold, and the read failed). A scan from past that message makes no consumer at all."""
        try:
            end = (await self.js.get_last_msg(stream or self.target.stream, subject)).seq
        except nats.js.errors.NotFoundError:
            return  # no message of `subject`
        if end is None or end < start_seq:
            return
        config = api.ConsumerConfig(
            deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE if start_seq > 0 else api.DeliverPolicy.ALL,
            opt_start_seq=start_seq if start_seq > 0 else None,
            ack_policy=api.AckPolicy.NONE,
            inactive_threshold=60.0,
            mem_storage=True,
            headers_only=headers_only,
            filter_subject=subject,
        )
        sub = await self.js.pull_subscribe(subject, stream=stream or self.target.stream, config=config)
        try:
            pending = (await sub.consumer_info()).num_pending
            messages = events = 0
            while pending:
                asked = min(pending, SCAN_FETCH_MESSAGES)
                if events_wanted is not None:
                    per_message = events / messages if messages else SCAN_EVENTS_PER_MESSAGE_GUESS
                    asked = min(asked, max(1, math.ceil((events_wanted - events) / per_message)))
                batch = await sub.fetch(asked, timeout=CALL_TIMEOUT_S)
                for msg in batch:
                    messages += 1
                    events += int((msg.headers or {}).get(H_COUNT, 1))
                    yield msg
                ended = not batch or batch[-1].metadata.sequence.stream >= end
                pending = 0 if ended else batch[-1].metadata.num_pending
        finally:
            await sub.unsubscribe()

    def _iterate(self, scan: AsyncIterator[Msg]) -> Iterator[Msg]:
        """A scan run from this thread, SCAN_FETCH_MESSAGES messages a call on the store's loop (one call a
        message spent most of a large read handing messages between threads)."""
        try:
            while True:
                batch = self._call(_next_messages(scan, SCAN_FETCH_MESSAGES))
                yield from batch
                if len(batch) < SCAN_FETCH_MESSAGES:
                    return
        finally:
            if not self._closed:
                self._call(scan.aclose())  # type: ignore[attr-defined]

    # -- the contract ------------------------------------------------------

    def store_id(self) -> str:
        return self._id

    def append(self, events: Sequence[Event]) -> int:
        return self._publish(events, checked=False, returning=False).stored

    def append_returning(self, events: Sequence[Event], *, checked: bool = False) -> Appended:
        return self._publish(events, checked=checked, returning=True).appended()

    def _publish(self, events: Sequence[Event], *, checked: bool, returning: bool) -> _Published:
        batch = self._checked(events, checked)
        try:
            return self._call(self._append(batch, returning), timeout=CALL_TIMEOUT_S * 2)
        except StoreUnavailable:
            for source in set(map(_source, batch)):
                self._stored_max.pop(source, None)  # what landed is unknown: read it again next time
            raise

    def _checked(self, events: Sequence[Event], checked: bool) -> list[Event]:
        """`events` as a list, every one checked before anything is published: the batch at once, and one
        at a time only when that finds something (`encode_rows` raises naming the first invalid one)."""
        batch = list(events)
        if not checked and not events_fit(batch):
            encode_rows(batch)
        return batch

    async def _append(self, events: list[Event], returning: bool) -> _Published:
        stored_max = {source: await self._highest(source) for source in set(map(_source, events))}
        groups = rising_groups(events, self.partitions, stored_max)
        if groups is None:  # a batch reaching at or below what is stored: a retry, or a spill's reload
            groups = await self._unstored_groups(events, stored_max)
        messages = [
            (self.target.subject(partition, source), members[first : first + MESSAGE_EVENTS_MAX])
            for (partition, source), members in groups.items()
            for first in range(0, len(members), MESSAGE_EVENTS_MAX)
        ]
        futures = []
        for subject, members in messages:
            source, first, last = members[0].source, members[0].seq, members[-1].seq
            headers = {
                MSG_ID: msg_id(source, first, last),
                H_SOURCE: source,
                H_FIRST: str(first),
                H_LAST: str(last),
                H_COUNT: str(len(members)),
            }
            payload = _encoder.encode(members)  # the array of the events' bodies, as decode_batch reads it
            futures.append(await self.js.publish_async(subject, payload, headers=headers, stream=self.target.stream))
        acks = await asyncio.wait_for(asyncio.gather(*futures), CALL_TIMEOUT_S)
        for (_, source), members in groups.items():
            newest = max(map(_seq, members))
            if newest > self._stored_max.get(source, 0):
                self._stored_max[source] = newest
        sizes = [len(members) for _, members in messages]
        kept = [members for _, members in messages] if returning else []
        return _Published(acks, sizes, kept, {s: high for s, high in stored_max.items() if high})

    async def _unstored_groups(
        self, events: list[Event], stored_max: dict[str, int]
    ) -> dict[tuple[int, str], list[Event]]:
        """`events` not stored yet, by (partition, source); a stored one with other content raises `ConflictError`."""
        rows = encode_rows(events, checked=True)
        seen: dict[tuple[str, int], bytes] = {}
        for source, high in stored_max.items():
            wanted = {row[1] for row in rows if row[0] == source and row[1] <= high}
            if wanted:
                seen.update(await self._stored_bodies(source, wanted))
        groups: dict[tuple[int, str], list[Event]] = {}
        for event, row in zip(events, rows, strict=True):
            key = (row[0], row[1])
            body = seen.get(key)
            if body is None:
                seen[key] = row[5]
                groups.setdefault((partition_of_event(event, self.partitions), row[0]), []).append(event)
            elif body != row[5]:
                raise ConflictError(f"{self.url}: {row[0]!r} seq {row[1]} is stored with different content")
        return groups

    async def _highest(self, source: str) -> int:
        """`source`'s highest stored seq (0: none): the largest last seq of its subjects' last messages."""
        known = self._stored_max.get(source)
        if known is not None:
            return known
        subjects = [self.target.subject(p, source) for p in range(self.partitions)]
        found = await asyncio.gather(*(self._last_seq_of(subject) for subject in subjects))
        high = self._stored_max[source] = max(found, default=0)
        return high

    async def _last_seq_of(self, subject: str) -> int:
        try:
            msg = await self.js.get_last_msg(self.target.stream, subject)
        except nats.js.errors.NotFoundError:
            return 0
        return int((msg.headers or {}).get(H_LAST, 0))

    async def _stored_bodies(self, source: str, wanted: set[int]) -> dict[tuple[str, int], bytes]:
        """The stored bodies of `source`'s events with a seq in `wanted` (a scan of the source's subjects)."""
        found: dict[tuple[str, int], bytes] = {}
        async for msg in self._scan(self.target.source_filter(source)):
            headers = msg.headers or {}
            if headers.get(H_SOURCE) != source:
                continue
            if int(headers.get(H_LAST, 0)) < min(wanted) or int(headers.get(H_FIRST, 0)) > max(wanted):
                continue
            for event in decode_batch(msg.data):
                if event.seq in wanted:
                    found[(source, event.seq)] = to_msgpack(event)
        return found

    def _events(self, subject: str, start_seq: int = 0) -> Generator[tuple[int, Event], None, None]:
        for msg in self._iterate(self._scan(subject, start_seq=start_seq)):
            yield from with_cursors(msg.metadata.sequence.stream, decode_batch(msg.data))

    def read(
        self,
        *,
        source: str | None = None,
        after_seq: int = 0,
        until_seq: int | None = None,
        transfer_id: TransferId | None = None,
        ts_from: float | None = None,
        ts_to: float | None = None,
        limit: int | None = None,
    ) -> Iterator[Event]:
        if self._closed:
            raise StoreError(f"{self.url}: store is closed")
        subjects = [self.target.subjects]
        if transfer_id is not None:
            subjects = self._transfer_subjects(transfer_id, source)
        elif source is not None:
            subjects = [self.target.source_filter(source)]
        return self._read(subjects, source, after_seq, until_seq, transfer_id, ts_from, ts_to, limit)

    def _transfer_subjects(self, transfer_id: TransferId, source: str | None) -> list[str]:
        """The subjects that hold `transfer_id`'s events (`source`'s, or every source's): its partition's, and
        partition 0's for its `drop`s (`partition_of_event`). A stream written before drops went to partition 0
        holds them in the transfer's partition: read there all the same."""
        partitions = sorted({partition_of(transfer_id, self.partitions), 0})
        if source is None:
            return [self.target.partition_filter(p) for p in partitions]
        return [self.target.subject(p, source) for p in partitions]

    def _events_of(self, subjects: list[str]) -> Iterator[tuple[int, Event]]:
        """The events of `subjects` (disjoint) in store order: each subject's scan, merged by cursor."""
        scans = [self._events(subject) for subject in subjects]
        try:
            yield from heapq.merge(*scans, key=itemgetter(0)) if len(scans) > 1 else scans[0]
        finally:
            for scan in scans:  # each holds a consumer on the server until closed
                scan.close()

    def _read(
        self,
        subjects: list[str],
        source: str | None,
        after_seq: int,
        until_seq: int | None,
        transfer_id: TransferId | None,
        ts_from: float | None,
        ts_to: float | None,
        limit: int | None,
    ) -> Iterator[Event]:
        emitted = 0
        for _, event in self._events_of(subjects):
            if limit is not None and emitted >= limit:
                return
            if (
                (source is not None and event.source != source)
                or event.seq <= after_seq
                or (until_seq is not None and event.seq > until_seq)
                or (transfer_id is not None and event.transfer_id != transfer_id)
                or (ts_from is not None and event.ts < ts_from)
                or (ts_to is not None and event.ts > ts_to)
            ):
                continue
            emitted += 1
            yield event

    def tail(self, after_cursor: int = 0, limit: int = 1000) -> list[tuple[int, Event]]:
        limit = min(limit, TAIL_EVENTS_MAX)
        out: list[tuple[int, Event]] = []
        if limit <= 0:
            return out
        start_seq = max(0, after_cursor) >> CURSOR_SHIFT
        # The messages in one call on the store's loop (not one call a message: a service tailing a fleet's
        # stream spent most of its time handing messages between threads), decoded here.
        for seq, data in self._call(self._tail_messages(start_seq, limit)):
            for cursor, event in with_cursors(seq, decode_batch(data)):
                if cursor <= after_cursor:
                    continue
                out.append((cursor, event))
                if len(out) >= limit:
                    return out
        return out

    async def _tail_messages(self, start_seq: int, events_max: int) -> list[tuple[int, bytes]]:
        """(stream sequence, body) of the stream's messages from `start_seq` on, until they hold `events_max`
        events (the first may hold some before the caller's cursor: one more message's worth at most)."""
        out: list[tuple[int, bytes]] = []
        counted = 0  # the events after the first message's (all of which may lie before the cursor)
        scan_of = self._scan(self.target.subjects, start_seq=start_seq, events_wanted=events_max + 1)
        async with contextlib.aclosing(scan_of) as scan:
            async for msg in scan:
                if out:
                    counted += int((msg.headers or {}).get(H_COUNT, 1))
                out.append((msg.metadata.sequence.stream, msg.data))
                if counted >= events_max:
                    break
        return out

    def sources(self) -> dict[str, int]:
        info = self._call(self.js.stream_info(self.target.stream, subjects_filter=self.target.subjects))
        subjects = list((info.state.subjects or {}).keys())
        lasts = self._call(self._gather_last(subjects))
        found: dict[str, int] = {}
        for source, last in lasts:
            if last > found.get(source, 0):
                found[source] = last
        return found

    async def _gather_last(self, subjects: list[str]) -> list[tuple[str, int]]:
        async def one(subject: str) -> tuple[str, int]:
            msg = await self.js.get_last_msg(self.target.stream, subject)
            headers = msg.headers or {}
            return headers.get(H_SOURCE, ""), int(headers.get(H_LAST, 0))

        return list(await asyncio.gather(*(one(subject) for subject in subjects)))

    def _counts(self, until_stream_seq: int | None = None) -> Iterator[tuple[int, int]]:
        """(stream seq, events) of every message, from headers alone."""
        for msg in self._iterate(self._scan(self.target.subjects, headers_only=True)):
            seq = msg.metadata.sequence.stream
            if until_stream_seq is not None and seq > until_stream_seq:
                return
            yield seq, int((msg.headers or {}).get(H_COUNT, 0))

    def count(self) -> int:
        return sum(n for _, n in self._counts())

    def count_through(self, cursor: int) -> int:
        last, place = max(0, cursor) >> CURSOR_SHIFT, max(0, cursor) & ((1 << CURSOR_SHIFT) - 1)
        return sum(n if seq < last else min(n, place) for seq, n in self._counts(last))

    def last_sequence(self) -> int:
        """The stream sequence of the newest message (0: none): every cursor is at or below
        `last_sequence() << 16 | 0xFFFF`."""
        info = self._call(self.js.stream_info(self.target.stream))
        return int(info.state.last_seq)

    def missing_messages(self) -> int:
        """Messages the stream once held and holds no more (a purge, a deletion, limits changed by hand): 0
        for a stream kvledger made and nobody edited. A nonzero answer means some events are gone."""
        info = self._call(self.js.stream_info(self.target.stream))
        return int(info.state.last_seq - info.state.messages)

    # -- snapshots -----------------------------------------------------------

    @property
    def _bucket(self) -> ObjectStore:
        assert self._objects is not None
        return self._objects

    def save_snapshot(self, snapshot: StoredSnapshot) -> None:
        meta = api.ObjectMeta(description=json.dumps({"format": snapshot.format, "created_ts": snapshot.created_ts}))
        self._call(self._bucket.put(_snapshot_name(snapshot.source, snapshot.seq), snapshot.body, meta=meta))

    async def _snapshot_seqs(self, source: str) -> list[int]:
        prefix = source.encode().hex() + "."
        try:
            infos = await self._bucket.list(ignore_deletes=True)
        except nats.js.errors.NotFoundError:
            return []
        return sorted(int(i.name[len(prefix) :]) for i in infos if i.name.startswith(prefix) and not i.deleted)

    def latest_snapshot(self, source: str, max_seq: int | None = None) -> StoredSnapshot | None:
        seqs = [s for s in self._call(self._snapshot_seqs(source)) if max_seq is None or s <= max_seq]
        if not seqs:
            return None
        result = self._call(self._bucket.get(_snapshot_name(source, seqs[-1])))
        meta = json.loads(result.info.description or "{}")
        body = bytes(result.data or b"")
        return StoredSnapshot(source, seqs[-1], int(meta["format"]), float(meta["created_ts"]), body)

    def delete_snapshots(self, source: str, below_seq: int) -> int:
        gone = [s for s in self._call(self._snapshot_seqs(source)) if s < below_seq]
        for seq in gone:
            self._call(self._bucket.delete(_snapshot_name(source, seq)))
        return len(gone)

    # -- quarantine ------------------------------------------------------

    def _quarantine_rows(self) -> list[Quarantined]:
        scan = self._scan(self.target.quarantine_subject, stream=self.target.quarantine_stream)
        out: list[Quarantined] = []
        for msg in self._iterate(scan):
            created, source, seq, reason, body = msgspec.msgpack.decode(msg.data)
            out.append(Quarantined(msg.metadata.sequence.stream, created, source, seq, reason, body))
        return out

    def quarantine(self, items: Sequence[tuple[Event, str]]) -> int:
        kept = {(q.source, q.body) for q in self._quarantine_rows()}
        new = 0
        for event, reason in items:
            row = quarantine_row(event, reason)
            if (row[1], row[4]) in kept:
                continue  # idempotent, like append
            kept.add((row[1], row[4]))
            subject, stream = self.target.quarantine_subject, self.target.quarantine_stream
            self._call(self.js.publish(subject, _encoder.encode(row), stream=stream))
            new += 1
        return new

    def quarantined(self, *, source: str | None = None, limit: int = QUARANTINE_READ_MAX) -> list[Quarantined]:
        found = [q for q in self._quarantine_rows() if source is None or q.source == source]
        return found[-min(limit, QUARANTINE_READ_MAX) :]

    def quarantined_count(self) -> int:
        info = self._call(self.js.stream_info(self.target.quarantine_stream))
        return int(info.state.messages)

    # -- life cycle ------------------------------------------------------

    def delete_stream(self) -> None:
        """Remove the stream and its side stores (tests and `kvledger db` tools; never called by the service)."""

        async def drop() -> None:
            for name in (self.target.stream, self.target.quarantine_stream):
                with contextlib.suppress(nats.js.errors.NotFoundError):
                    await self.js.delete_stream(name)
            with contextlib.suppress(nats.js.errors.NotFoundError):
                await self.js.delete_object_store(self.target.snapshot_bucket)

        self._call(drop())

    def close(self) -> None:
        if self._closed:
            return
        nc = self._nc

        async def shut() -> None:
            if nc is not None and not nc.is_closed:
                await nc.close()

        try:
            if nc is not None:
                asyncio.run_coroutine_threadsafe(shut(), self._loop).result(CALL_TIMEOUT_S)
        except Exception:  # closing a connection to a dead server: nothing left to save
            pass
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(CALL_TIMEOUT_S)


def open_nats_store(target: NatsTarget, *, create: bool) -> NatsStore:
    return NatsStore(target, create=create)
