"""What peers tell this rank (the worker half's control plane): release acks, write results, remote_blocks
(where a WRITE consumer wants its bytes), lease renewals, and the one-sided read confirmations (mori).
Each message becomes events of this rank's ledger; a message that may not be acted on is refused and
recorded, never raised."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvledger.connector.limits import (
    POLL_IDS_MAX,
    REMOTE_DIRECTORY_MAX,
    UNMAPPED_SIDES_MAX,
)
from kvledger.connector.messages import (
    LeaseRenew,
    Message,
    RankAddress,
    ReadConfirm,
    ReadIntent,
    ReleaseBlocks,
    RemoteBlocks,
    WriteDone,
    WriteFailed,
)
from kvledger.connector.metadata import PeerRef
from kvledger.connector.moves import DataMoves
from kvledger.connector.reasons import REASON_READ_REFUSED
from kvledger.connector.transports.base import Code
from kvledger.connector.worker_base import RemoteTarget
from kvledger.ledger.events import Ack, Event, Fail, TransferId

log = logging.getLogger(__name__)


def consumer_of(address: RankAddress | PeerRef) -> str:
    """A consumer engine's identity as a binding names it: its host, base notify port and dp rank (its TP
    ranks are one consumer: each renews with its own rank, the fold's fan-in)."""
    return f"{address.host}:{address.notify_port}/dp{address.dp_rank}"


class PeerMessages(DataMoves):
    """Messages from peers, turned into events."""

    def _take_messages(self, now: float, events: list[Event]) -> None:
        """Handle what peers said, POLL_IDS_MAX transfer ids at most (a lease renewal counts the ids it names,
        every other message one): the rest waits in order for the next poll, a lease half handled in
        `_carried` from where it stopped, so a flood of large messages costs each hook a bounded amount of
        work and loses nothing. Messages are drained only as far as the ids left may reach (each names one
        at least), so `_carried` never holds more than POLL_IDS_MAX of them."""
        budget = POLL_IDS_MAX
        carried = self._carried
        self._unmapped_room = UNMAPPED_SIDES_MAX - len(self.state.unmapped)
        while budget > 0:
            if not carried:
                carried.extend((message, 0) for message in self.channel.drain(budget))
                if not carried:
                    return
            message, start = carried.popleft()
            if isinstance(message, LeaseRenew):
                ids = message.transfer_ids
                end = min(len(ids), start + budget)
                self._on_lease(message, ids[start:end], now, events)
                budget -= max(1, end - start)
                if end < len(ids):
                    carried.appendleft((message, end))
            else:
                self._on_message(message, now, events)
                budget -= 1

    def _on_message(self, message: Message, now: float, events: list[Event]) -> None:
        source = self.source
        if isinstance(message, ReleaseBlocks):
            if self._may_record(message.transfer_id):
                events.append(
                    Ack(ts=now, source=source, transfer_id=message.transfer_id, what="release", rank=message.rank)
                )
        elif isinstance(message, WriteDone):
            if self._may_record(message.transfer_id):
                events.append(
                    Ack(ts=now, source=source, transfer_id=message.transfer_id, what="recv", rank=message.rank)
                )
        elif isinstance(message, WriteFailed):
            if self._may_record(message.transfer_id):
                events.append(
                    Fail(
                        ts=now,
                        source=source,
                        transfer_id=message.transfer_id,
                        reason=f"write_failed from rank {message.rank}: {message.reason}",
                        code=message.code,
                    )
                )
        elif isinstance(message, RemoteBlocks):
            self._on_remote_blocks(message, now)
        elif isinstance(message, LeaseRenew):
            self._on_lease(message, message.transfer_ids, now, events)
        elif isinstance(message, ReadIntent):
            self._on_read_intent(message, now, events)
        elif isinstance(message, ReadConfirm):
            self._on_read_confirm(message, now, events)
        else:
            self.counters["unexpected_message"] += 1

    def _may_record(self, tid: TransferId) -> bool:
        """Whether a peer's word about `tid` (a release, write_done, write_failed) may become an event. Always
        for an id this rank knows (live, decided, compacted, or already waiting for its map: the fold judges
        it, and a late or duplicate one is an audit finding); for an id it never mapped, while the poll's room
        for never-mapped sides lasts (`_unmapped_room`: UNMAPPED_SIDES_MAX less those open). Each such event
        opens a side that waits for its map and, should none come, expires as an `orphan_ack` finding. Past
        the room it is counted, not recorded (`unknown_ids_refused`, in the figures' control_dropped): a
        flood of unknown ids costs a lookup and a counter each, not a side and two events each."""
        key = (self.source, tid)
        state = self.state
        if key in state.transfers or state.was_mapped(key):
            return True
        if self._unmapped_room > 0:
            self._unmapped_room -= 1
            return True
        refused = self.counters["unknown_ids_refused"] = self.counters["unknown_ids_refused"] + 1
        if refused & (refused - 1) == 0:  # the 1st, 2nd, 4th, ...: a flood is a few lines, not one per id
            log.warning(
                "%d messages named transfers this rank never mapped while %d never-mapped sides were open: "
                "counted (unknown_ids_refused), not recorded",
                refused,
                UNMAPPED_SIDES_MAX,
            )
        return False

    def _on_lease(self, message: LeaseRenew, ids: Sequence[str], now: float, events: list[Event]) -> None:
        """Producer: a consumer rank still waits for these transfers (`ids`: the message's, or the part of
        them this poll takes); each side this rank holds is held one
        lease from now (an `ack` what=lease the fold moves the deadline with), never past kv_lease_max from
        its map. Renewals for sides not held (decided, or never mapped here) are counted and not recorded: a
        renewal cannot create a side. A renewal counts only from the consumer the side is bound to
        (`_bound_consumer`): another peer, even one holding the key, cannot hold a transfer's blocks."""
        c = self.config
        if c.role != "producer" or not c.leases:
            self.counters["lease_renewals_ignored"] += len(ids)
            return
        sender = message.sender
        if sender is None or sender.tp_rank != message.rank:
            self.counters["lease_renewals_unbound"] += len(ids)
            return
        hold_max = max(c.defer_timeout_s, c.kv_lease_max_s) - c.defer_timeout_s
        for tid in ids:
            t = self._live(TransferId(tid))
            m = t.map_event if t is not None else None
            if t is None or m is None or t.role != "producer":
                self.counters["lease_renewals_for_unheld"] += 1
                continue
            if not self._bound_consumer(TransferId(tid), consumer_of(sender)):
                self.counters["lease_renewals_wrong_consumer"] += 1
                continue
            # The map's deadline is the scheduler's map time + defer_timeout: the cap is the scheduler
            # half's backstop, so the worker never holds longer than the scheduler keeps the blocks.
            until = min(now + c.kv_lease_duration_s, m.deadline + hold_max)
            self.counters["lease_renewals"] += 1
            events.append(
                Ack(
                    ts=now,
                    source=self.source,
                    transfer_id=TransferId(tid),
                    what="lease",
                    rank=message.rank,
                    until=until,
                )
            )

    def _bound_consumer(self, tid: TransferId, consumer: str) -> bool:
        """Whether `consumer` is the one `tid` (a live side of this rank) was handed to: the first consumer
        that asked for it (WRITE: the metadata's peer, bound at map; READ: its first read intent or lease
        renewal) binds it, for as long as the side lives (dropped at release)."""
        bound = self.consumers.setdefault(tid, consumer)
        return bound == consumer

    def _on_read_intent(self, message: ReadIntent, now: float, events: list[Event]) -> None:
        """Producer: answer whether this rank holds the transfer. Before a read, hold it at least a transfer
        timeout more (an `ack` what=lease: the read's own lease), so it cannot expire while the NIC reads."""
        c, sender = self.config, message.sender
        port = sender.port(sender.notify_port)
        if c.role != "producer" or not c.may_dial(sender.host, port):
            self.counters["read_intent_refused"] += 1
            return
        tid = TransferId(message.transfer_id)
        held = self._holds(tid)
        t = self._live(tid)
        if held and not self._bound_consumer(tid, consumer_of(sender)):
            self.counters["read_intents_wrong_consumer"] += 1
            held = False  # not this peer's transfer: it may not read (nor hold) it
        if held and not message.after and t is not None and t.map_event is not None:
            cap = t.map_event.deadline - c.defer_timeout_s + max(c.defer_timeout_s, c.kv_lease_max_s)
            until = min(now + c.transfer_timeout_s, cap)
            events.append(Ack(ts=now, source=self.source, transfer_id=tid, what="lease", until=until))
        self.counters[f"read_intents_{'held' if held else 'unknown' if held is None else 'released'}"] += 1
        self._send(sender.host, port, ReadConfirm(transfer_id=tid, rank=c.tp_rank, held=held, after=message.after))

    def _on_read_confirm(self, message: ReadConfirm, now: float, events: list[Event]) -> None:
        """Consumer: the producer's answer. Before: held, the read goes; not yet mapped, ask again after a
        backoff (a transient failure); let go, a load error. After: held throughout, the read counts; else
        its bytes may be another request's KV: a load error, never a success."""
        tid = TransferId(message.transfer_id)
        state, t = self._confirming.get(tid), self._live(tid)
        if t is None or state != ("after" if message.after else "before"):
            self.counters["read_confirms_unexpected"] += 1
            return
        source = self.source
        if message.held is None and not message.after:
            del self._confirming[tid]
            reason = f"{Code.NOT_HELD_YET.name}: the producer has not mapped the transfer yet"
            events.append(Fail(ts=now, source=source, transfer_id=tid, reason=reason, retryable=True))
            return
        if not message.held:
            del self._confirming[tid]
            self.counters["reads_refused"] += 1
            when = "after the read" if message.after else "before the read"
            reason = f"{REASON_READ_REFUSED}: the producer did not hold the transfer {when}"
            events.append(Fail(ts=now, source=source, transfer_id=tid, reason=reason, code="read_refused"))
            return
        if message.after:
            del self._confirming[tid]
            self.counters["reads_confirmed"] += 1
            events.append(Ack(ts=now, source=source, transfer_id=tid, what="read"))
            return
        self._confirming[tid] = "confirmed"
        self._start_read(t, now, attempt=t.transient_failures)

    def _released_unread(self, tid: TransferId) -> bool:
        """Whether this rank let `tid` go by expiry or failure (not by completing it: a duplicate remote_blocks
        after write_done changes nothing)."""
        if self._live(tid) is not None:
            return False
        side = self.state.side((self.source, tid))
        return side is not None and side.decision is not None and side.decision.cause != "completed"

    def _on_remote_blocks(self, message: RemoteBlocks, now: float) -> None:
        sender = message.sender
        port = sender.port(sender.notify_port)
        if self.config.role != "producer" or not self.config.may_dial(sender.host, port):
            self.counters["remote_blocks_refused"] += 1
            log.warning(
                "remote_blocks for %s from %s:%s refused (not a configured peer)",
                message.transfer_id,
                sender.host,
                port,
            )
            return
        target = RemoteTarget(
            message.block_ids, sender, message.prompt_digest, message.block_groups, generation=message.generation
        )
        tid = message.transfer_id
        if self.config.refuse_released_reads and self._released_unread(tid):
            # Released (expired, failed, completed) before the consumer said where to write: its blocks may
            # hold another request's KV now. The consumer is told at once (a load error; vLLM recomputes).
            self.counters["late_reads_refused"] += 1
            reason = f"{REASON_READ_REFUSED}: the producer released this transfer before remote_blocks came"
            self._send(
                sender.host,
                port,
                WriteFailed(transfer_id=tid, rank=self.config.tp_rank, reason=reason, code="read_refused"),
            )
            return
        if not self._same_prompt(message.transfer_id, target):
            self._refuse_other_prompt(message.transfer_id, target)
            return
        self.remote[message.transfer_id] = target
        while len(self.remote) > REMOTE_DIRECTORY_MAX:
            self.remote.popitem(last=False)
        t = self._live(message.transfer_id)
        if t is not None and t.expected is not None:
            self._write_missing_layers(t, attempt=0, now=now)

    def _same_prompt(self, tid: TransferId, target: RemoteTarget) -> bool:
        """Whether the consumer asking for `tid`'s KV has the prompt this rank holds `tid` for (unknown on
        either side, as from a peer without digests, counts as the same: the transfer id alone binds)."""
        mine = self.digests.get(tid)
        return mine is None or target.prompt_digest is None or mine == target.prompt_digest

    def _refuse_other_prompt(self, tid: TransferId, target: RemoteTarget) -> None:
        """A consumer request naming a transfer id this rank holds for another prompt (a client reusing
        ids): it is told write_failed, so it never decodes this request's KV as its own; the transfer
        itself waits on for its own consumer."""
        self.remote.pop(tid, None)
        self.counters["remote_blocks_other_prompt"] += 1
        log.warning("remote_blocks for %s name another prompt than this rank holds it for: refused", tid)
        sender = target.sender
        port = sender.port(sender.notify_port)
        self._send(sender.host, port, WriteFailed(transfer_id=tid, rank=self.config.tp_rank, reason="prompt_mismatch"))
