"""The worker half of the connector core: moves KV for one rank and records what it sees.

Called from the worker's one thread; the channel's listener, the linker's
handshake threads and the transport's I/O threads only hand it messages, link
results and handle statuses, which `poll(now)` turns into events of this rank's
ledger (`<engine>/tp<r>`). No call here waits on a peer: a transfer whose peer is
not linked yet waits in the waiting room and fails, naming the peer, at its
deadline; whatever a transport raises is that transfer's `fail`. What to report
to vLLM (finished sends and receives, load errors) and what to tell peers
(write_done, write_failed, release) follows from the releases the fold decides.
Besides the ledger it keeps only I/O state: in-flight transport handles, the
linker's links, the waiting room, and (WRITE producer) where the consumer wants
its bytes; each transfer's part of it goes with the transfer's decision.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from connector.channel import Channel, PeerNotAllowed
from connector.config import ConnectorConfig
from connector.index import RequestIndex
from connector.layout import Geometry, LayerDescriptor, LayoutError, block_ops, geometry_of
from connector.limits import (
    HANDSHAKE_TIMEOUT_S,
    LEASE_IDS_PER_MESSAGE_MAX,
    LINK_WAIT_MAX,
    POLL_MESSAGES_MAX,
    REMOTE_DIRECTORY_MAX,
    RETRY_BACKOFF_MAX_S,
    RETRY_BACKOFF_MIN_S,
)
from connector.linker import Linker
from connector.links import PeerKey, PeerLink
from connector.maps import side_map
from connector.messages import (
    HandshakeMetadata,
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
from connector.metadata import FailItem, LeaseItem, PeerRef, StepMetadata
from connector.ports import holder_ranks, rank_port, releases_expected
from connector.store import abandon_inherited
from connector.transports.base import Code, Op, TransferHandle, Transport
from connector.waiting import WaitingRoom
from ledger.decisions import Release, VllmOutcome
from ledger.events import Ack, Drop, Event, Fail, FailCode, ReqId, Schedule, Seal, TransferId, block_groups_of
from ledger.ledger import Ledger
from ledger.side import TransferState, awaits_data

log = logging.getLogger(__name__)

REASON_LAYOUT = "layout_mismatch"
REASON_READ_REFUSED = "read_refused"
"""The words of a `read_refused` fail (its code says it to the fold)."""
REASON_TRANSIENT_TIMEOUT = "transient_failures_past_transfer_timeout"
REASON_PEER_UNLINKED = "peer_not_linked"
"""A transfer waited a transfer timeout for its peer's handshake: the reason names the peer (the log says why)."""
REASON_PEER_NOT_ALLOWED = "peer_not_allowed"
REASON_TRANSPORT = "transport_error"
"""The transport raised (connect, read or write) instead of returning a failed status."""
REASON_NOT_SENT = "notification_not_sent"
REASON_WAIT_FULL = "too_many_transfers_waiting_for_links"


class LinkRefused(ValueError):
    """A handshake's answer that may not be used (an endpoint outside the allow-list, another transport)."""


@dataclass
class RemoteTarget:
    """WRITE producer: where the consumer wants the bytes (from its remote_blocks message)."""

    block_ids: tuple[int, ...]
    sender: RankAddress
    prompt_digest: str | None = None


@dataclass
class Inflight:
    """One transfer's outstanding transport batches: (layer index or None for a whole read, handle)."""

    handles: list[tuple[int | None, TransferHandle]] = field(default_factory=list)
    read_failed: bool = False
    read_failed_terminally: bool = False
    """A terminal failure of this read was recorded (a second one would be a late event)."""


@functools.lru_cache(maxsize=4096)
def _cached_ops(
    local: Geometry, remote: Geometry, local_blocks: tuple[int, ...], remote_blocks: tuple[int, ...]
) -> tuple[Op, ...]:
    # Every layer of a model shares a few geometries, so a transfer's ops are computed once, not per layer.
    return tuple(block_ops(local, remote, local_blocks, remote_blocks))


class WorkerCore:
    def __init__(
        self,
        config: ConnectorConfig,
        ledger: Ledger,
        transport: Transport,
        channel: Channel,
        *,
        gated_links: bool = False,
    ) -> None:
        if config.mode == "write" and config.role == "consumer" and config.peer_tp_size > config.tp_size:
            raise ValueError("WRITE mode with a larger producer TP needs a recv fan-in the fold does not have yet")
        self.config = config
        self.ledger = ledger
        self.source = ledger.source
        self.state = ledger.state
        self.transport = transport
        self.channel = channel
        self.index = RequestIndex(ledger.log)
        self.counters: Counter[str] = Counter()
        self.layers: dict[str, LayerDescriptor] = {}
        self.layer_groups: dict[str, int] = {}
        self.layer_names: list[str] = []
        self.layer_index: dict[str, int] = {}
        self.linker = Linker(
            self._handshake, self._accept_link, retry_cap_s=config.transfer_timeout_s, gated=gated_links
        )
        """Handshakes off the step: hooks only ask it whether a peer is linked yet."""
        self.waiting = WaitingRoom(LINK_WAIT_MAX)
        """Transfers deferred until their peer links (failed at their deadline)."""
        self.remote: OrderedDict[TransferId, RemoteTarget] = OrderedDict()
        self.inflight: dict[TransferId, Inflight] = {}
        self.peers: dict[TransferId, PeerRef] = {}
        """The peer of each live transfer, from the metadata (I/O addressing, dropped at release)."""
        self.digests: dict[TransferId, str] = {}
        """WRITE: each live transfer's prompt digest, from the metadata (dropped at release): what a
        consumer's remote_blocks must match before anything is written there."""
        self._step_saves: dict[TransferId, list[int]] = {}
        self._step_recv: list[TransferId] = []
        self._unreported = VllmOutcome()
        """What vLLM has yet to hear from this rank: receives and load errors at the next report, finished
        sends once vLLM has said the request finished (`_finished_seen`)."""
        self._finished_seen: set[ReqId] = set()
        self._confirming: dict[TransferId, str] = {}
        """One-sided reads (mori) being confirmed with the producer: `before` (asked, the read waits),
        `confirmed` (the read may go), `after` (landed, asked whether the hold lasted). Dropped at release."""
        self._last_now = 0.0
        """The clock of the last call that had one (the forward's save_kv_layer has none)."""
        inherited = abandon_inherited(ledger)  # reopened after a restart: those requests died with the process
        if inherited:
            self.counters["inherited_transfers_failed"] = inherited
        if config.role == "producer" and config.refuse_released_reads:
            transport.set_hold_check(self._holds)

    # -- setup ----------------------------------------------------------------

    def register_kv_caches(
        self, caches: Mapping[str, Any], num_blocks: int | None = None, layer_groups: Mapping[str, int] | None = None
    ) -> None:
        """Register every layer's KV tensor with the transport and publish the handshake metadata.
        `layer_groups`: each layer's KV cache group (hybrid models); a layer not named is in group 0."""
        self.layer_groups = dict(layer_groups or {})
        for name, tensor in caches.items():
            region = self.transport.register(name, tensor)
            self.layers[name] = LayerDescriptor(name=name, geometry=geometry_of(tensor, num_blocks), region=region)
        self.layer_names = list(self.layers)
        self.layer_index = {name: i for i, name in enumerate(self.layer_names)}
        c = self.config
        self.channel.set_metadata(
            HandshakeMetadata(
                engine_id=c.engine_id,
                dp_rank=c.dp_rank,
                tp_rank=c.tp_rank,
                tp_size=c.tp_size,
                endpoint=self.transport.endpoint(),
                layers=tuple(self.layers.values()),
            )
        )

    # -- per step: metadata in -------------------------------------------------

    def bind(self, meta: StepMetadata, now: float) -> None:
        """bind_connector_metadata: map this step's transfers in this rank's ledger."""
        c, source = self.config, self.source
        self._last_now = now
        fan_in = releases_expected(c.peer_tp_size, c.tp_size) if c.role == "producer" else 1
        events: list[Event] = []
        for send in meta.send:
            events.append(
                side_map(
                    ts=now,
                    source=source,
                    transfer_id=send.transfer_id,
                    request_id=send.request_id,
                    role="producer",
                    mode="read",
                    block_ids=send.block_ids,
                    deadline=send.deadline,
                    acks_expected=fan_in,
                    block_groups=send.block_groups,
                )
            )
        for save in meta.save:
            if save.peer is not None:
                self.peers[save.transfer_id] = save.peer
            if save.prompt_digest is not None:
                self.digests[save.transfer_id] = save.prompt_digest
            events.append(
                side_map(
                    ts=now,
                    source=source,
                    transfer_id=save.transfer_id,
                    request_id=save.request_id,
                    role="producer",
                    mode="write",
                    block_ids=save.block_ids,
                    deadline=save.deadline,
                    peer=save.peer,
                    acks_expected=fan_in,
                )
            )
            self._step_saves[save.transfer_id] = []
        for recv in meta.recv:
            self.peers[recv.transfer_id] = recv.peer
            if recv.prompt_digest is not None:
                self.digests[recv.transfer_id] = recv.prompt_digest
            events.append(
                side_map(
                    ts=now,
                    source=source,
                    transfer_id=recv.transfer_id,
                    request_id=recv.request_id,
                    role="consumer",
                    mode=recv.mode,
                    block_ids=recv.block_ids,
                    remote_block_ids=recv.remote_block_ids,
                    peer=recv.peer,
                    deadline=recv.deadline,
                    block_groups=recv.block_groups,
                    remote_block_groups=recv.remote_block_groups,
                )
            )
            self._step_recv.append(recv.transfer_id)
        if events:
            self.ledger.extend(events)
        for save in meta.save:
            target = self.remote.get(save.transfer_id)
            if target is not None and not self._same_prompt(save.transfer_id, target):
                self._refuse_other_prompt(save.transfer_id, target)  # its remote_blocks came first
        for failed in meta.failed:
            self._scheduler_failed(failed, now)
        for abort in meta.abort:
            self._tell_holders(
                abort.peer, ReleaseBlocks(transfer_id=abort.transfer_id, rank=c.tp_rank, consumer_tp_size=c.tp_size)
            )
        if meta.lease:
            self._renew(meta.lease)

    def _renew(self, items: list[LeaseItem]) -> None:
        """Consumer: tell each waiting transfer's holder ranks to hold on (one message per peer, batched). Never
        waits: a renewal the channel could not queue is counted, and the next one comes a sixth of a lease on."""
        by_peer: dict[PeerRef, list[TransferId]] = {}
        for item in items:
            tid = item.transfer_id
            if self.state.was_mapped((self.source, tid)) and self._live(tid) is None:
                continue  # this side decided (read or failed): nothing to hold for
            by_peer.setdefault(item.peer, []).append(tid)
        rank = self.config.tp_rank
        for peer, tids in by_peer.items():
            for start in range(0, len(tids), LEASE_IDS_PER_MESSAGE_MAX):
                chunk = tuple(tids[start : start + LEASE_IDS_PER_MESSAGE_MAX])
                if self._tell_holders(peer, LeaseRenew(transfer_ids=chunk, rank=rank)):
                    self.counters["lease_renewals_sent"] += len(chunk)
                else:
                    self.counters["lease_renewals_not_sent"] += len(chunk)

    def _holds(self, transfer_id: str) -> bool | None:
        """The tcp transport's server thread asks: does this producer rank still hold `transfer_id`? True: held;
        False: let go (never held again); None: not mapped here yet (the metadata comes with the next step,
        while the scheduler half already holds the blocks). Dict lookups, atomic under the GIL: a side leaves
        `live` at its decision, before vLLM hears of it (and frees its blocks), and never comes back."""
        key = (self.source, TransferId(transfer_id))
        t = self.state.live.get(key)
        if t is not None:
            return t.role == "producer"
        return False if self.state.was_mapped(key) else None

    def _scheduler_failed(self, failed: FailItem, now: float) -> None:
        """The scheduler half decided a receive failed: report it to vLLM from here (failed_recving and load
        errors), once. A side this rank holds fails in its ledger (and so is reported, and the producer
        told); a side it decided itself was reported then; one it never mapped is reported as it stands."""
        tid = failed.transfer_id
        if self.state.was_mapped((self.source, tid)):
            if self._live(tid) is not None:
                self._fail(tid, f"scheduler: {failed.reason}", now)
            return
        self.counters["scheduler_failures_reported"] += 1
        self._unreported.add_failed_recv(failed.request_id, failed.block_ids)

    def start_load(self, now: float) -> None:
        """start_load_kv: READ consumers issue their reads; WRITE consumers tell the producer where to write."""
        recv, self._step_recv = self._step_recv, []
        for tid in recv:
            t = self._live(tid)
            if t is None:
                continue
            if t.mode == "read":
                self._start_read(t, now, attempt=0)
            else:
                digest = self.digests.get(tid)
                me = self.config.rank_address
                message = RemoteBlocks(transfer_id=tid, block_ids=t.block_ids, sender=me, prompt_digest=digest)
                if not self._tell_holders(self.peers[tid], message):
                    # The producer will never learn where to write: waiting out the recv timeout helps nobody.
                    self.ledger.append(
                        Fail(ts=now, source=self.source, transfer_id=tid, reason=f"{REASON_NOT_SENT}: remote_blocks")
                    )
        self.poll(now)

    # -- the forward: WRITE producer ---------------------------------------------

    def save_layer(self, layer_name: str) -> None:
        """save_kv_layer: write this layer for every transfer completing in this step whose remote is known.

        The hot path (layers x requests calls a step): no events here; the layers
        issued are buffered and appended as one `schedule` per transfer in `wait_for_save`.
        """
        if not self._step_saves:
            return
        layer = self.layer_index.get(layer_name)
        if layer is None:
            return
        for tid, issued in self._step_saves.items():
            if layer in issued:
                continue  # a layer already written is not written again
            if self._write_layer(tid, layer, now=None):
                issued.append(layer)

    def wait_for_save(self, now: float) -> None:
        """Record what this step's forward issued and seal the number of layer writes to expect."""
        saves, self._step_saves = self._step_saves, {}
        source, expected = self.source, len(self.layer_names)
        events: list[Event] = []
        for tid, issued in saves.items():
            if self._live(tid) is None:
                continue  # failed during the forward (layout, transport): nothing more to record
            if issued:
                events.append(Schedule(ts=now, source=source, transfer_id=tid, op="write", layers=tuple(issued)))
            else:
                # The consumer has not said where to write yet: the writes happen when it does.
                events.append(Schedule(ts=now, source=source, transfer_id=tid, op="write", layers=(), deferred=True))
            events.append(Seal(ts=now, source=source, transfer_id=tid, expected=expected))
        if events:
            self.ledger.extend(events)
        # vLLM calls start_load_kv (and so poll) after the forward when no load is synchronous: a
        # remote_blocks drained there came after save_kv_layer but before this seal, and nothing else
        # would issue its writes (the transfer would sit until the defer deadline).
        for tid, issued in saves.items():
            t = self._live(tid)
            if t is not None and len(issued) < expected and tid in self.remote:
                self._write_missing_layers(t, attempt=0, now=now)

    # -- per step: reports out ---------------------------------------------------

    def get_finished(self, finished_req_ids: Iterable[ReqId], now: float) -> tuple[set[ReqId], set[ReqId], set[ReqId]]:
        """(finished sending, finished receiving, failed receiving) since the last call.

        A finished send is reported only once vLLM has told this worker that the
        request finished (vLLM's rule for get_finished), so a WRITE that lands
        during the prompt's own forward waits for that notice.
        """
        out = self._unreported
        for request_id in finished_req_ids:
            if request_id in out.finished_sending or self._producing(request_id):
                self._finished_seen.add(request_id)
        self.poll(now)
        sending = out.finished_sending & self._finished_seen
        out.finished_sending -= sending
        self._finished_seen -= sending
        recving, out.finished_recving = out.finished_recving, set()
        failed, out.failed_recving = out.failed_recving, set()
        return sending, recving, failed

    def take_load_errors(self) -> set[int]:
        """get_block_ids_with_load_errors: blocks of failed receives, reported no later than the request."""
        out = self._unreported
        errors, out.invalid_block_ids = out.invalid_block_ids, set()
        return errors

    # -- the poll: wire and transport in, events out ---------------------------------

    def _producing(self, request_id: ReqId) -> bool:
        """Whether `request_id` is a live producer side of this rank (whose finished notice must be kept)."""
        tid = self.index.get(request_id)
        if tid is None:
            return False
        t = self._live(tid)
        return t is not None and t.role == "producer"

    def poll(self, now: float) -> None:
        self.linker.adopt(now)
        events: list[Event] = []
        for dropped in self.channel.take_dropped(POLL_MESSAGES_MAX):
            # Unproven control messages: recorded (the audit's forged_message), never acted on.
            self.counters["forged_messages_dropped"] += 1
            events.append(
                Drop(
                    ts=now,
                    source=self.source,
                    transfer_id=TransferId(dropped.transfer_id or "-"),
                    message=dropped.message_type,
                    sender=dropped.sender,
                    reason=dropped.reason,
                )
            )
        for message in self.channel.drain(POLL_MESSAGES_MAX):
            self._on_message(message, now, events)
        self._collect(now, events)
        if events:
            self.ledger.extend(events)
        self._resume_waiting(now)
        self._retry(now)
        self._tick(now)
        self._act_on_releases()
        self.ledger.maintain(now, retain_s=self.config.defer_timeout_s)

    def _on_message(self, message: Message, now: float, events: list[Event]) -> None:
        source = self.source
        if isinstance(message, ReleaseBlocks):
            events.append(
                Ack(ts=now, source=source, transfer_id=message.transfer_id, what="release", rank=message.rank)
            )
        elif isinstance(message, WriteDone):
            events.append(Ack(ts=now, source=source, transfer_id=message.transfer_id, what="recv", rank=message.rank))
        elif isinstance(message, WriteFailed):
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
            self._on_lease(message, now, events)
        elif isinstance(message, ReadIntent):
            self._on_read_intent(message, now, events)
        elif isinstance(message, ReadConfirm):
            self._on_read_confirm(message, now, events)
        else:
            self.counters["unexpected_message"] += 1

    def _on_lease(self, message: LeaseRenew, now: float, events: list[Event]) -> None:
        """Producer: a consumer rank still waits for these transfers; each side this rank holds is held one
        lease from now (an `ack` what=lease the fold moves the deadline with), never past kv_lease_max from
        its map. Renewals for sides not held (decided, or never mapped here) are counted and not recorded: a
        renewal cannot create a side."""
        c = self.config
        if c.role != "producer" or not c.leases:
            self.counters["lease_renewals_ignored"] += len(message.transfer_ids)
            return
        hold_max = max(c.defer_timeout_s, c.kv_lease_max_s) - c.defer_timeout_s
        for tid in message.transfer_ids:
            t = self._live(TransferId(tid))
            m = t.map_event if t is not None else None
            if t is None or m is None or t.role != "producer":
                self.counters["lease_renewals_for_unheld"] += 1
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

    # -- one-sided reads (mori): confirmed with the producer before and after -----------------

    def _must_confirm(self) -> bool:
        return self.config.refuse_released_reads and bool(getattr(self.transport, "one_sided", False))

    def _ask_holders(self, tid: TransferId, peer: PeerRef, *, after: bool, now: float) -> None:
        self._confirming[tid] = "after" if after else "before"
        if not self._tell_holders(peer, ReadIntent(transfer_id=tid, sender=self.config.rank_address, after=after)):
            self._fail(tid, f"{REASON_NOT_SENT}: read_intent", now)

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
        target = RemoteTarget(message.block_ids, sender, message.prompt_digest)
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

    def _tick(self, now: float) -> None:
        self.ledger.expire_due(now, transfer_timeout_s=self.config.transfer_timeout_s)

    def _act_on_releases(self) -> None:
        """What each decision obliges this rank to do: report it to vLLM and tell the peer."""
        c = self.config
        for release in self.ledger.take_releases():
            tid = release.transfer_id
            self.index.forget(release.request_id, tid)
            self.inflight.pop(tid, None)
            self._confirming.pop(tid, None)
            self.waiting.drop(tid)
            self._step_saves.pop(tid, None)
            peer = self.peers.pop(tid, None)
            self.digests.pop(tid, None)
            self._unreported.add(release)
            if release.role == "producer":
                if release.mode == "write":
                    self._tell_consumer(release)
                continue
            self._finished_seen.discard(release.request_id)
            # READ: the holders may free now (whatever the cause); WRITE: only a receive that did not
            # complete needs telling, so that the producer stops writing into blocks we give back.
            if peer is not None and (release.mode == "read" or release.cause != "completed"):
                self._tell_holders(peer, ReleaseBlocks(transfer_id=tid, rank=c.tp_rank, consumer_tp_size=c.tp_size))

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

    def _tell_consumer(self, release: Release) -> None:
        target = self.remote.pop(release.transfer_id, None)
        if target is None:
            return  # the consumer never said where it was: it was aborted, or will time out on its own
        sender = target.sender
        port = sender.port(sender.notify_port)
        if release.cause == "completed":
            message: Message = WriteDone(transfer_id=release.transfer_id, rank=self.config.tp_rank)
        else:
            message = WriteFailed(
                transfer_id=release.transfer_id, rank=self.config.tp_rank, reason=f"{release.cause}: {release.reason}"
            )
        self._send(sender.host, port, message)

    # -- I/O helpers -------------------------------------------------------------------

    def _live(self, tid: TransferId) -> TransferState | None:
        t = self.state.live.get((self.source, tid))
        return t

    def _send(self, host: str, port: int, message: Message) -> bool:
        """Hand `message` to the channel (never blocks); False, counted and logged, if it was not sent."""
        try:
            sent = self.channel.send(host, port, message)
        except PeerNotAllowed as error:
            self.counters["send_refused"] += 1
            log.warning("%s not sent: %s", type(message).__name__, error)
            return False
        except Exception as error:  # a socket error is this message's failure, never the hook's
            self.counters["send_error"] += 1
            log.warning("%s to %s:%s not sent: %s", type(message).__name__, host, port, error)
            return False
        return sent

    def _tell_holders(self, peer: PeerRef, message: Message) -> bool:
        """Send `message` to every holder rank of `peer`; True if every one was sent."""
        sent = True
        for rank in holder_ranks(self.config.tp_rank, self.config.tp_size, peer.tp_size):
            sent = (
                self._send(peer.host, rank_port(peer.notify_port, peer.dp_rank, rank, peer.tp_size), message) and sent
            )
        return sent

    def _handshake(self, host: str, port: int) -> HandshakeMetadata | None:
        """The linker's threads: ask the peer rank for its metadata (may wait the handshake timeout)."""
        return self.channel.handshake(host, port, self.config.rank_address, HANDSHAKE_TIMEOUT_S)

    def _accept_link(self, host: str, port: int, metadata: HandshakeMetadata) -> PeerLink:
        """The worker's thread, at the poll after a handshake finished: check the answer, connect."""
        endpoint = metadata.endpoint
        if endpoint.backend != self.transport.backend:
            self.counters["handshake_redirect_refused"] += 1
            raise LinkRefused(f"{host}:{port} speaks {endpoint.backend!r}, not {self.transport.backend!r}")
        if endpoint.host != host or not self.config.may_dial(endpoint.host, endpoint.port):
            # A handshake may not redirect us to another host, or to a port no peer was configured with.
            self.counters["handshake_redirect_refused"] += 1
            raise LinkRefused(f"{host}:{port} named endpoint {endpoint.host}:{endpoint.port}, not allow-listed")
        session = self.transport.connect(endpoint, [layer.region for layer in metadata.layers])
        return PeerLink(metadata, session, {layer.name: layer.geometry for layer in metadata.layers})

    def _link(self, tid: TransferId, peer: PeerKey, now: float | None) -> PeerLink | None:
        """The link with `peer` if its handshake completed, else None with `tid` parked until it does (or
        failed at once, for a peer outside the allow-list). Never waits. `now` None: the forward's hot
        path, which records nothing (the transfer is parked with the next poll's clock)."""
        link = self.linker.link(peer, now if now is not None else self._last_now)
        if link is not None:
            return link
        if not self.config.may_dial(*peer):
            self._fail(tid, f"{REASON_PEER_NOT_ALLOWED}: {peer[0]}:{peer[1]}", now)
            return None
        at = now if now is not None else self._last_now
        if not self.waiting.park(tid, peer, at + self.config.transfer_timeout_s):
            self._fail(tid, f"{REASON_WAIT_FULL} ({LINK_WAIT_MAX})", now)
        return None

    def _fail(self, tid: TransferId, reason: str, now: float | None, *, retryable: bool = False) -> None:
        at = now if now is not None else self._last_now
        self.counters["transient_failures" if retryable else "terminal_failures"] += 1
        self.ledger.append(Fail(ts=at, source=self.source, transfer_id=tid, reason=reason, retryable=retryable))

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
        link = self._link(tid, key, now)
        if link is None:
            return  # parked until the peer links (or failed: not allow-listed)
        if self._must_confirm() and self._confirming.get(tid) != "confirmed":
            if tid not in self._confirming:
                self._ask_holders(tid, peer, after=False, now=now)
            return  # the read goes when the producer confirms it holds the transfer
        flight = Inflight()
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
        link = self._link(tid, key, now)
        if link is None:
            return False
        name = self.layer_names[layer]
        remote_geometry = link.geometry.get(name)
        if remote_geometry is None:
            self._fail(tid, f"{REASON_LAYOUT}: consumer has no layer {name!r}", now)
            return False
        if len(target.block_ids) > len(t.block_ids):
            self._fail(
                tid,
                f"{REASON_LAYOUT}: consumer has {len(target.block_ids)} blocks, producer {len(t.block_ids)}",
                now,
            )
            return False
        try:
            # Paired from the consumer's side (its list may be shorter: a prefix hit), then turned round.
            ops = _cached_ops(remote_geometry, self.layers[name].geometry, target.block_ids, t.block_ids)
            swapped = [(producer, consumer, size) for consumer, producer, size in ops]
            handle = self.transport.write(link.session, name, name, swapped)
        except LayoutError as error:
            self._fail(tid, f"{REASON_LAYOUT}: {error}", now)
            return False
        except Exception as error:  # the transport raised instead of returning a failed status
            self._fail(tid, f"{REASON_TRANSPORT}: write: {type(error).__name__}: {error}", now)
            return False
        self.inflight.setdefault(tid, Inflight()).handles.append((layer, handle))
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

    # -- shutdown ------------------------------------------------------------------------

    def close(self) -> None:
        self.linker.close()
        self.channel.close()
        self.transport.close()
        self.ledger.close()
