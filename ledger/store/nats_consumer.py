"""Durable pull consumers of a NATS stream's partitions, for partition workers (nats-py stays in here).

One JetStream durable pull consumer per partition, filtering `<stream>.ev.<partition>.>`, named
`<service>-<stream>-p<partition>`: two services over one stream (each its own `service` name) keep
positions of their own, and a worker started again under the same name goes on from its consumer's
position. Messages come in stream order; each is a batch of one source's events of the partition
(`nats_store.py`), its events handed to the caller with their store cursors (`stream seq << 16 | place`,
the cursor every reader of the store sees).

Acknowledgement is the caller's: `ack(partition, through)` acknowledges every message up to stream
sequence `through` (the consumer's ack policy is *all*), once the caller's fold of them is safe (a
partition worker acks what a saved snapshot holds: `kvledger.ledger.fleet`). What was delivered and not
acknowledged is delivered again: after a crash, or once `ack_wait_s` passed. A message delivered again
is recognised by its stream sequence, which names one stored batch, `(source, first seq, last seq)` in
its headers: the store stores each (source, seq) once (`Nats-Msg-Id`, and its stored-seq check beyond the
duplicate window), so a stream sequence at or below the highest this consumer has handed over (or the
caller folded before it started) is a batch already folded. It is passed over, counted, never handed over
again.

`Delivered.upto` says how far the partition is known complete: every message of the partition at or
below that stream sequence has been handed over (or was folded before). A fetch that finds nothing new
moves it to the stream's last sequence as read before the fetch, once the consumer says nothing of its
filter is pending; so a partition no engine writes to still moves on, and a merge of partitions
(`kvledger.ledger.partitioned.Merger`) waits on no idle one.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Mapping, Sequence
from typing import TypeAlias

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api

from kvledger.ledger.events import Event
from kvledger.ledger.store.base import StoreError
from kvledger.ledger.store.nats_store import CALL_TIMEOUT_S, NatsStore, decode_batch, with_cursors
from kvledger.ledger.store.nats_stream import CURSOR_SHIFT
from kvledger.ledger.store.partition_source import Delivered

SERVICE_DEFAULT = "kvledger"
ACK_WAIT_S = 600.0
"""How long a delivered message may go unacknowledged before JetStream delivers it again: longer than a
worker's snapshot interval (`kvledger.ledger.limits.FLEET_SNAPSHOT_EVERY_S`), so a live worker is not sent
again what it folded; a dead one's messages come back to its successor anyway (redelivery at start)."""
FETCH_MESSAGES = 256
"""Messages one fetch asks for, shared out among the owned partitions (up to MESSAGE_EVENTS_MAX events each)."""

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

_Fetched: TypeAlias = tuple[int, list[tuple[int, bytes]], int, int, int]
"""One partition's fetch, not yet decoded: (partition, (stream seq, body) of each new message, the last one's
stream seq, upto, messages passed over)."""


def consumer_name(service: str, stream: str, partition: int) -> str:
    """The durable consumer of `partition` of `stream` for the service `service`."""
    if not _NAME.fullmatch(service):
        raise ValueError(f"service name {service!r}: letters, digits, '_' and '-', up to 64")
    return f"{service}-{stream}-p{partition}"


class _Partition:
    """One partition's durable consumer and what this process knows of it."""

    def __init__(self, partition: int, name: str, sub: JetStreamContext.PullSubscription, handed: int) -> None:
        self.partition = partition
        self.name = name
        self.sub = sub
        self.handed = handed
        """The highest stream sequence handed over (or folded before the start): the line below which a
        message is delivered again."""
        self.upto = handed
        self.unacked: list[tuple[int, Msg]] = []
        """(stream seq, message) of each fetch's last message not yet acknowledged, ascending."""


class PartitionConsumers:
    """The durable consumers of the partitions one worker owns (see the module docstring): a
    `kvledger.ledger.store.partition_source.PartitionSource`."""

    cursor_shift = CURSOR_SHIFT
    behind = False
    """Not told: a worker saves on its clock as well as by events (`kvledger.ledger.fleet.run_worker`)."""

    def __init__(
        self,
        store: NatsStore,
        partitions: Sequence[int],
        *,
        service: str = SERVICE_DEFAULT,
        folded: Mapping[int, int] | None = None,
        ack_wait_s: float = ACK_WAIT_S,
    ) -> None:
        """`folded`: per partition, the stream sequence the caller's fold already holds (a restored
        snapshot's); what the consumer delivers at or below it is passed over. A consumer whose position
        (acknowledged through) is past what the caller holds, the fold that acknowledged it being lost, is
        made again from the stream's start: the caller folds everything again, and nothing is skipped."""
        self.store = store
        self.service = service
        self.ack_wait_s = ack_wait_s
        self.stream = store.target.stream
        owned = sorted(set(partitions))
        if not owned or any(not 0 <= p < store.partitions for p in owned):
            raise ValueError(f"partitions {list(partitions)} are not within range({store.partitions})")
        self.reset: list[int] = []
        """Partitions whose consumer was made again from the start (its position was past `folded`)."""
        held = dict(folded or {})
        self.parts: dict[int, _Partition] = {}
        for p in owned:
            self.parts[p] = store._call(self._open(p, held.get(p, 0)))

    def _config(self, partition: int, name: str, start: int = 0) -> api.ConsumerConfig:
        return api.ConsumerConfig(
            name=name,
            durable_name=name,
            filter_subject=self.store.target.partition_filter(partition),
            deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE if start > 1 else api.DeliverPolicy.ALL,
            opt_start_seq=start if start > 1 else None,
            ack_policy=api.AckPolicy.ALL,
            ack_wait=self.ack_wait_s,
            max_ack_pending=-1,
            max_deliver=-1,
        )

    async def _open(self, partition: int, folded: int) -> _Partition:
        """Bind to the partition's durable consumer (made where there is none). Messages a consumer handed to
        a process that died unacknowledged would come back only after `ack_wait_s`: the consumer is made
        again from its position then (the stream sequence after what it acknowledged), so they come at once,
        and are passed over where the caller folded them already."""
        js = self.store.js
        name = consumer_name(self.service, self.stream, partition)
        try:
            info = await js.consumer_info(self.stream, name)
        except nats.js.errors.NotFoundError:
            info = await js.add_consumer(self.stream, self._config(partition, name))
        floor = int(info.ack_floor.stream_seq or 0) if info.ack_floor is not None else 0
        if floor > folded:  # acknowledged past what the caller holds: its fold of them was lost
            await js.delete_consumer(self.stream, name)
            await js.add_consumer(self.stream, self._config(partition, name))
            self.reset.append(partition)
            folded = 0
        elif info.num_ack_pending:
            await js.delete_consumer(self.stream, name)
            await js.add_consumer(self.stream, self._config(partition, name, floor + 1))
        sub = await js.pull_subscribe_bind(consumer=name, stream=self.stream)
        return _Partition(partition, name, sub, folded)

    def position(self, partition: int) -> int:
        """The consumer's position: the stream sequence it has acknowledged through (0: none)."""
        info = self.store._call(self.store.js.consumer_info(self.stream, self.parts[partition].name))
        return int(info.ack_floor.stream_seq or 0) if info.ack_floor is not None else 0

    def fetch(self, messages: int | None = FETCH_MESSAGES, timeout: float = 0.2) -> list[Delivered]:
        """The owned partitions' next messages (up to `messages` in all, shared out among them), waiting up to
        `timeout` seconds where none is there; one `Delivered` per partition, in partition order. The
        messages are decoded here, on the caller's thread, not on the connection's."""
        each = max(1, (messages or FETCH_MESSAGES) // len(self.parts))
        fetched = self.store._call(self._fetch_all(each, timeout), timeout=timeout + CALL_TIMEOUT_S)
        out = []
        for partition, bodies, last_seq, upto, again in fetched:
            rows: list[tuple[int, Event]] = []
            for seq, data in bodies:
                rows.extend(with_cursors(seq, decode_batch(data)))
            out.append(Delivered(partition, rows, last_seq, upto, again))
        return out

    async def _fetch_all(self, messages: int, timeout: float) -> list[_Fetched]:
        last = (await self.store.js.stream_info(self.stream)).state.last_seq
        return list(await asyncio.gather(*(self._fetch(part, messages, timeout, last) for part in self.parts.values())))

    async def _fetch(self, part: _Partition, messages: int, timeout: float, last: int) -> _Fetched:
        try:
            msgs = await part.sub.fetch(messages, timeout=timeout)
        except TimeoutError:  # nats-py raises its own, or asyncio's when the deadline passed between requests
            msgs = []
        bodies: list[tuple[int, bytes]] = []
        again = 0
        new_last = 0
        for msg in msgs:
            seq = msg.metadata.sequence.stream
            if seq <= part.handed:
                again += 1
                continue
            bodies.append((seq, msg.data))
            part.handed = new_last = seq
        if msgs:
            part.unacked.append((msgs[-1].metadata.sequence.stream, msgs[-1]))
            pending = msgs[-1].metadata.num_pending
        else:
            pending = (await part.sub.consumer_info()).num_pending or 0
        part.upto = max(part.upto, part.handed, last if pending == 0 else 0)
        return part.partition, bodies, new_last, part.upto, again

    def ack(self, partition: int, through: int) -> None:
        """Acknowledge every message of `partition` up to stream sequence `through`: the caller's fold of
        them is safe (saved). Messages above it stay unacknowledged (delivered again after a crash)."""
        part = self.parts[partition]
        ready = [pair for pair in part.unacked if pair[0] <= through]
        if not ready:
            return
        part.unacked = [pair for pair in part.unacked if pair[0] > through]
        self.store._call(ready[-1][1].ack_sync(timeout=CALL_TIMEOUT_S))

    def delete(self) -> None:
        """Remove these durable consumers from the server (a service retired for good; tests)."""

        async def drop() -> None:
            for part in self.parts.values():
                with contextlib.suppress(nats.js.errors.NotFoundError):
                    await self.store.js.delete_consumer(self.stream, part.name)

        self.store._call(drop())

    def close(self) -> None:
        """Stop fetching (the durable consumers stay on the server, at their positions)."""

        async def unsubscribe() -> None:
            for part in self.parts.values():
                with contextlib.suppress(nats.errors.Error, StoreError):
                    await part.sub.unsubscribe()

        if not self.store._closed:
            self.store._call(unsubscribe())
