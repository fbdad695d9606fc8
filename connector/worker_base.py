"""What every part of the worker half shares: its state (the ledger, the transport, the channel, the
linker and waiting room, and the I/O state that goes with each transfer's decision) and the I/O helpers
every part calls: sending to a peer, linking to one, recording a failure. Nothing here waits on a peer."""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field

from kvledger.connector.channel import Channel, PeerNotAllowed
from kvledger.connector.config import ConnectorConfig
from kvledger.connector.index import RequestIndex
from kvledger.connector.layout import LayerDescriptor
from kvledger.connector.limits import (
    HANDSHAKE_TIMEOUT_S,
    LINK_WAIT_MAX,
)
from kvledger.connector.linker import Linker
from kvledger.connector.links import PeerKey, PeerLink
from kvledger.connector.mamba import MambaGroup, MambaMismatch, check_compatible
from kvledger.connector.messages import (
    HandshakeMetadata,
    Message,
    RankAddress,
    ReadIntent,
)
from kvledger.connector.metadata import PeerRef
from kvledger.connector.ports import holder_ranks, rank_port
from kvledger.connector.reasons import REASON_NOT_SENT, REASON_PEER_NOT_ALLOWED, REASON_PEER_RESTARTED, REASON_WAIT_FULL
from kvledger.connector.store import abandon_inherited
from kvledger.connector.transports.base import TransferHandle, Transport
from kvledger.connector.waiting import WaitingRoom
from kvledger.ledger.decisions import VllmOutcome
from kvledger.ledger.events import Fail, ReqId, TransferId
from kvledger.ledger.ledger import Ledger
from kvledger.ledger.side import TransferState

log = logging.getLogger(__name__)


class LinkRefused(ValueError):
    """A handshake's answer that may not be used (an endpoint outside the allow-list, another transport)."""


@dataclass
class RemoteTarget:
    """WRITE producer: where the consumer wants the bytes (from its remote_blocks message)."""

    block_ids: tuple[int, ...]
    sender: RankAddress
    prompt_digest: str | None = None
    block_groups: tuple[int, ...] | None = None
    """Hybrid models: `block_ids` per KV cache group, as counts (None: one group)."""
    generation: int = 0
    """The consumer rank's life that sent them (the message's `generation`): written only over a link to it."""


@dataclass
class Inflight:
    """One transfer's outstanding transport batches: (layer index or None for a whole read, handle)."""

    handles: list[tuple[int | None, TransferHandle]] = field(default_factory=list)
    read_failed: bool = False
    read_failed_terminally: bool = False
    """A terminal failure of this read was recorded (a second one would be a late event)."""
    peer: PeerKey | None = None
    link: PeerLink | None = None
    """The peer rank and the link its batches went over: a failure meaning the peer is gone forgets that link."""


class WorkerBase:
    """The worker's state and I/O helpers; the parts below add what they do with them."""

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
        self.mamba: tuple[MambaGroup, ...] = ()
        """This rank's Mamba groups (hybrid Mamba models), published in the handshake and checked against a peer's."""
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
        self.consumers: dict[TransferId, str] = {}
        """Producer: the consumer each live side is bound to (`PeerMessages._bound_consumer`; dropped at
        release): the only one whose lease renewals and read intents count."""
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
        self._carried: deque[tuple[Message, int]] = deque()
        """Messages a poll took from the channel and has not handled all of, in order, each with the index of
        its first id not yet handled (a lease renewal names many): the next poll starts with them
        (`PeerMessages._take_messages`; at most POLL_IDS_MAX)."""
        self._unmapped_room = 0
        """How many more never-mapped sides this poll's messages may open (`PeerMessages._may_record`)."""
        self._relinking: dict[TransferId, int] = {}
        """Transfers that found their peer's link from another life than they name and asked for a new
        handshake: the link serial they doubted (a link adopted since that still differs fails them). Dropped
        at release."""
        inherited = abandon_inherited(ledger)  # reopened after a restart: those requests died with the process
        if inherited:
            self.counters["inherited_transfers_failed"] = inherited
        if config.role == "producer" and config.refuse_released_reads:
            transport.set_hold_check(self._holds)

    @property
    def generation(self) -> int:
        """This rank's life (`connector/generation.py`): its channel stamps every message and the handshake
        metadata with it, and its tcp transport's endpoint carries the same (`assemble.build_worker` draws it
        once for both)."""
        return self.channel.generation

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
        try:
            me, peer = f"{self.config.engine_id} tp{self.config.tp_rank}", f"{metadata.engine_id} tp{metadata.tp_rank}"
            check_compatible(self.mamba, metadata.mamba, me, peer)
        except MambaMismatch:
            self.counters["handshake_mamba_refused"] += 1
            raise
        session = self.transport.connect(endpoint, [layer.region for layer in metadata.layers])
        return PeerLink(metadata, session, {layer.name: layer.geometry for layer in metadata.layers})

    def _link(self, tid: TransferId, peer: PeerKey, now: float | None, generation: int = 0) -> PeerLink | None:
        """The link with `peer` if its handshake completed and it is of the life `generation` names (0: any),
        else None with `tid` parked until it is (or failed: a peer outside the allow-list, a life that is
        over). Never waits. `now` None: the forward's hot path, which records nothing (the transfer is parked
        with the next poll's clock)."""
        link = self.linker.link(peer, now if now is not None else self._last_now)
        if link is not None:
            if not generation or link.generation == generation:
                if self._relinking:
                    self._relinking.pop(tid, None)
                return link
            if not self._relink(tid, peer, link, generation, now):
                return None
        if not self.config.may_dial(*peer):
            self._fail(tid, f"{REASON_PEER_NOT_ALLOWED}: {peer[0]}:{peer[1]}", now)
            return None
        at = now if now is not None else self._last_now
        if not self.waiting.park(tid, peer, at + self.config.transfer_timeout_s):
            self._fail(tid, f"{REASON_WAIT_FULL} ({LINK_WAIT_MAX})", now)
        return None

    def _relink(self, tid: TransferId, peer: PeerKey, link: PeerLink, generation: int, now: float | None) -> bool:
        """`tid` names another life of `peer` than its link: True when it should wait for a new handshake (the
        link is forgotten and one starts, off the step); False when it failed, because the life it names is
        over (a handshake since showed another), so no link will ever have its layout."""
        state = self.linker.states[peer]
        asked = self._relinking.get(tid)
        if generation in state.ended or (asked is not None and state.serial > asked):
            self._relinking.pop(tid, None)
            self.counters["transfers_peer_restarted"] += 1
            # The linker logged the restart once (`Linker.adopt`); each transfer it ends is an event, not a line.
            detail = f"the peer is generation {link.generation}, the transfer names {generation}"
            self._fail(tid, f"{REASON_PEER_RESTARTED}: {detail}", now)
            return False
        self.counters["links_stale"] += 1
        self.linker.forget(peer, link)
        self._relinking[tid] = state.serial
        self.linker.link(peer, now if now is not None else self._last_now)  # the new handshake starts now
        return True

    def _fail(self, tid: TransferId, reason: str, now: float | None, *, retryable: bool = False) -> None:
        at = now if now is not None else self._last_now
        self.counters["transient_failures" if retryable else "terminal_failures"] += 1
        self.ledger.append(Fail(ts=at, source=self.source, transfer_id=tid, reason=reason, retryable=retryable))

    def _must_confirm(self) -> bool:
        return self.config.refuse_released_reads and bool(getattr(self.transport, "one_sided", False))

    def _ask_holders(self, tid: TransferId, peer: PeerRef, *, after: bool, now: float) -> None:
        self._confirming[tid] = "after" if after else "before"
        if not self._tell_holders(peer, ReadIntent(transfer_id=tid, sender=self.config.rank_address, after=after)):
            self._fail(tid, f"{REASON_NOT_SENT}: read_intent", now)

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
