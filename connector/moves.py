"""Moving KV (the worker half's data plane): reads a consumer starts, layers a WRITE producer writes,
their transport handles collected into acks and fails, transient failures retried with backoff, and
transfers resumed once their peer links. Every transport fault becomes a `fail` event."""

from __future__ import annotations

import functools
import logging

from kvledger.connector.layout import Geometry, LayoutError, block_ops
from kvledger.connector.limits import (
    RETRY_BACKOFF_MAX_S,
    RETRY_BACKOFF_MIN_S,
)
from kvledger.connector.ports import holder_ranks, rank_port
from kvledger.connector.reasons import (
    REASON_LAYOUT,
    REASON_PEER_UNLINKED,
    REASON_READ_REFUSED,
    REASON_TRANSIENT_TIMEOUT,
    REASON_TRANSPORT,
)
from kvledger.connector.transports.base import PEER_GONE, Code, Op, TransferHandle
from kvledger.connector.worker_base import Inflight, WorkerBase
from kvledger.ledger.events import Ack, Event, Fail, FailCode, Schedule, TransferId, block_groups_of
from kvledger.ledger.side import TransferState, awaits_data

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=4096)
def _cached_ops(
    local: Geometry, remote: Geometry, local_blocks: tuple[int, ...], remote_blocks: tuple[int, ...]
) -> tuple[Op, ...]:
    # Every layer of a model shares a few geometries, so a transfer's ops are computed once, not per layer.
    return tuple(block_ops(local, remote, local_blocks, remote_blocks))


class DataMoves(WorkerBase):
    """Reads, writes, their handles, retries and resumptions."""

    def _collect(self, now: float, events: list[Event]) -> None:
        """Turn finished transport handles into acks and fails."""
        source = self.source
        for tid in list(self.inflight):
            flight = self.inflight[tid]
            done_layers: list[int] = []
            still: list[tuple[int | None, TransferHandle]] = []
            for layer, handle in flight.handles:
                status = handle.status()
                if status.in_progress():
                    still.append((layer, handle))
                elif status.succeeded():
                    if layer is not None:
                        done_layers.append(layer)
                else:
                    if layer is None and flight.read_failed_terminally:
                        continue  # the read already failed for good: its other layers' failures add nothing
                    flight.read_failed = flight.read_failed or layer is None
                    if layer is None and not status.transient:
                        flight.read_failed_terminally = True
                    went = flight.peer
                    # The peer the link was made with is gone (or restarted): the next use handshakes again.
                    if status.code in PEER_GONE and went is not None and self.linker.forget(went, flight.link):
                        self.counters["links_forgotten_peer_gone"] += 1
                    reason = f"{status.code.name}: {status.message}"
                    code: FailCode = "error"
                    if status.code == Code.REFUSED:
                        self.counters["reads_refused"] += 1
                        reason, code = f"{REASON_READ_REFUSED}: {reason}", "read_refused"
                    events.append(
                        Fail(
                            ts=now, source=source, transfer_id=tid, reason=reason, retryable=status.transient, code=code
                        )
                    )
                    self.counters["transient_failures" if status.transient else "terminal_failures"] += 1
            if done_layers:
                events.append(Ack(ts=now, source=source, transfer_id=tid, what="write", layers=tuple(done_layers)))
            # A read lands when every layer's batch of this attempt succeeded.
            reading = any(layer is None for layer, _ in flight.handles)
            if reading and not still and not flight.read_failed:
                if self._must_confirm():
                    peer = self.peers.get(tid)
                    if peer is not None:
                        self._ask_holders(tid, peer, after=True, now=now)  # landed: did the hold last?
                else:
                    events.append(Ack(ts=now, source=source, transfer_id=tid, what="read"))
            if still:
                flight.handles = still
            else:
                del self.inflight[tid]

    def _retry(self, now: float) -> None:
        """Re-issue operations that failed transiently, after a backoff, until transfer_timeout."""
        failures: list[Event] = []
        for t in list(self.state.retrying.values()):  # the fold's index, not a scan of every live side
            if t.transfer_id in self.inflight:
                continue
            tid = TransferId(t.transfer_id)
            if not awaits_data(t) or (t.role == "producer" and tid not in self.remote):
                continue  # nothing of its own to move, or a WRITE producer not yet told where to write
            since = t.transient_since if t.transient_since is not None else t.first_ts
            if now - since >= self.config.transfer_timeout_s:  # counted from the first transient failure
                failures.append(Fail(ts=now, source=self.source, transfer_id=tid, reason=REASON_TRANSIENT_TIMEOUT))
                continue
            backoff = min(RETRY_BACKOFF_MIN_S * 2 ** (t.transient_failures - 1), RETRY_BACKOFF_MAX_S)
            if now < t.last_ts + backoff:
                continue
            if t.role == "consumer":
                self._start_read(t, now, attempt=t.transient_failures)
            else:
                self._write_missing_layers(t, attempt=t.transient_failures, now=now)
        if failures:
            self.ledger.extend(failures)

    def _resume_waiting(self, now: float) -> None:
        """Transfers whose peer linked go on; those that waited past their deadline fail, naming the peer."""
        self._last_now = now
        for peer in self.waiting.peers():
            if self.linker.link(peer, now) is not None:
                for tid in self.waiting.release_peer(peer):
                    self._resume(tid, now)
                continue
            for tid in self.waiting.overdue(peer, now):
                if self._live(tid) is not None:
                    # The event names the peer; the log says why (attempt counts depend on thread timing).
                    log.warning("%s: %s:%s %s", tid, peer[0], peer[1], self.linker.describe(peer))
                    self._fail(tid, f"{REASON_PEER_UNLINKED}: {peer[0]}:{peer[1]}", now)

    def _resume(self, tid: TransferId, now: float) -> None:
        t = self._live(tid)
        if t is None or tid in self.inflight:
            return
        if t.role == "consumer" and t.mode == "read":
            self._start_read(t, now, attempt=t.transient_failures)
        elif t.role == "producer" and t.mode == "write" and t.expected is not None:
            self._write_missing_layers(t, attempt=t.transient_failures, now=now)

    def _start_read(self, t: TransferState, now: float, attempt: int) -> None:
        tid = TransferId(t.transfer_id)
        peer = self.peers.get(tid)
        holders = holder_ranks(self.config.tp_rank, self.config.tp_size, peer.tp_size) if peer else []
        if peer is None or len(holders) != 1 or peer.tp_size != self.config.tp_size:
            self._fail(tid, f"{REASON_LAYOUT}: only equal TP sizes move data yet", now)
            return
        key = (peer.host, rank_port(peer.handshake_port, peer.dp_rank, holders[0], peer.tp_size))
        link = self._link(tid, key, now, peer.generation_of(holders[0]))
        if link is None:
            return  # parked until the peer links as the life the params name (or failed: not allowed, or over)
        if self._must_confirm() and self._confirming.get(tid) != "confirmed":
            if tid not in self._confirming:
                self._ask_holders(tid, peer, after=False, now=now)
            return  # the read goes when the producer confirms it holds the transfer
        flight = Inflight(peer=key, link=link)
        m = t.map_event
        assert m is not None, "a live transfer has its map"
        # Hybrid models: each layer moves the blocks of its own KV cache group.
        local_groups = block_groups_of(m.block_ids, m.block_groups)
        remote_groups = block_groups_of(m.remote_block_ids or (), m.remote_block_groups)
        try:
            for name, layer in self.layers.items():
                remote_geometry = link.geometry.get(name)
                if remote_geometry is None:
                    raise LayoutError(f"peer has no layer {name!r}")
                group = self.layer_groups.get(name, 0)
                if group >= min(len(local_groups), len(remote_groups)):
                    raise LayoutError(f"layer {name!r} is in KV cache group {group}, which the transfer lacks")
                ops = _cached_ops(layer.geometry, remote_geometry, local_groups[group], remote_groups[group])
                if ops:
                    flight.handles.append((None, self.transport.read(link.session, name, name, ops, transfer_id=tid)))
        except LayoutError as error:
            self._fail(tid, f"{REASON_LAYOUT}: {error}", now)
            return
        except Exception as error:  # the transport raised instead of returning a failed status
            self._fail(tid, f"{REASON_TRANSPORT}: read: {type(error).__name__}: {error}", now)
            return
        self.ledger.append(Schedule(ts=now, source=self.source, transfer_id=tid, op="read", attempt=attempt))
        if flight.handles:
            self.inflight[tid] = flight
        else:
            # Nothing to move (every block was a local prefix hit): the read is trivially complete.
            self.ledger.append(Ack(ts=now, source=self.source, transfer_id=tid, what="read"))

    def _write_layer(self, tid: TransferId, layer: int, now: float | None) -> bool:
        """Issue one layer's write if the consumer's blocks are known and its rank linked; True if issued.

        What can never succeed (a layout the consumer's blocks do not fit, a layer the consumer lacks, a
        transport that raises) fails the transfer at once (terminal), as a READ does."""
        target = self.remote.get(tid)
        t = self._live(tid)
        if target is None or t is None:
            return False
        sender = target.sender
        key = (sender.host, sender.port(sender.handshake_port))
        link = self._link(tid, key, now, target.generation)
        if link is None:
            return False
        name = self.layer_names[layer]
        remote_geometry = link.geometry.get(name)
        if remote_geometry is None:
            self._fail(tid, f"{REASON_LAYOUT}: consumer has no layer {name!r}", now)
            return False
        m = t.map_event
        assert m is not None, "a live transfer has its map"
        # Hybrid models: each layer (a Mamba layer's state regions too) writes the blocks of its own KV cache
        # group, as a READ consumer reads them.
        group = self.layer_groups.get(name, 0)
        local_groups = block_groups_of(m.block_ids, m.block_groups)
        remote_groups = block_groups_of(target.block_ids, target.block_groups)
        if group >= min(len(local_groups), len(remote_groups)):
            self._fail(
                tid,
                f"{REASON_LAYOUT}: layer {name!r} is in KV cache group {group}; the producer has "
                f"{len(local_groups)} groups, the consumer {len(remote_groups)}",
                now,
            )
            return False
        mine, theirs = local_groups[group], remote_groups[group]
        if len(theirs) > len(mine):
            where = f" (KV cache group {group})" if len(local_groups) > 1 else ""
            self._fail(tid, f"{REASON_LAYOUT}: consumer has {len(theirs)} blocks, producer {len(mine)}{where}", now)
            return False
        try:
            # Paired from the consumer's side (its list may be shorter: a prefix hit), then turned round.
            ops = _cached_ops(remote_geometry, self.layers[name].geometry, theirs, mine)
            swapped = [(producer, consumer, size) for consumer, producer, size in ops]
            handle = self.transport.write(link.session, name, name, swapped)
        except LayoutError as error:
            self._fail(tid, f"{REASON_LAYOUT}: {error}", now)
            return False
        except Exception as error:  # the transport raised instead of returning a failed status
            self._fail(tid, f"{REASON_TRANSPORT}: write: {type(error).__name__}: {error}", now)
            return False
        self.inflight.setdefault(tid, Inflight(peer=key, link=link)).handles.append((layer, handle))
        return True

    def _write_missing_layers(self, t: TransferState, attempt: int, now: float) -> None:
        """Write every expected layer not yet issued (deferred) or not yet landed (retry)."""
        tid = TransferId(t.transfer_id)
        expected = t.expected if t.expected is not None else len(self.layer_names)
        flying = {layer for layer, _ in self.inflight[tid].handles} if tid in self.inflight else set()
        done = t.scheduled_mask if attempt == 0 else t.acked_mask  # bit i: layer i issued / landed
        issued: list[int] = []
        for layer in range(expected):
            if done >> layer & 1 or layer in flying:
                continue
            if not self._write_layer(tid, layer, now):
                break  # parked for a link, or failed: the other layers wait (or go) with it
            issued.append(layer)
        if issued and self._live(tid) is not None:
            self.ledger.append(
                Schedule(ts=now, source=self.source, transfer_id=tid, op="write", layers=tuple(issued), attempt=attempt)
            )

    def _give_up(self, tid: TransferId) -> None:
        """`tid` is decided: its outstanding batches are given up (`TransferHandle.cancel`), so a transport that
        keeps per-request state (tcp) frees their in-flight slots now rather than at their deadline, and drops
        whatever the peer answers later instead of landing it in blocks that may hold another request's KV."""
        flight = self.inflight.pop(tid, None)
        if flight is not None:
            for _, handle in flight.handles:
                handle.cancel()
