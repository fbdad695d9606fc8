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

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvledger.connector.layout import LayerDescriptor, geometry_of
from kvledger.connector.limits import (
    LEASE_IDS_PER_MESSAGE_MAX,
    POLL_DROPS_MAX,
)
from kvledger.connector.mamba import MambaGroup, mamba_layer_groups, state_tensors
from kvledger.connector.maps import side_map
from kvledger.connector.messages import (
    HandshakeMetadata,
    LeaseRenew,
    Message,
    ReleaseBlocks,
    RemoteBlocks,
    WriteDone,
    WriteFailed,
)
from kvledger.connector.metadata import FailItem, LeaseItem, PeerRef, StepMetadata
from kvledger.connector.peer_messages import PeerMessages, consumer_of
from kvledger.connector.ports import releases_expected
from kvledger.connector.reasons import REASON_NOT_SENT
from kvledger.ledger.decisions import Release
from kvledger.ledger.events import Drop, Event, Fail, ReqId, Schedule, Seal, TransferId


class WorkerCore(PeerMessages):
    """The worker half as vLLM's worker hooks call it: metadata in, the forward's saves, the poll, reports
    out. Reading order: `worker_base.py` (state and I/O helpers), `moves.py` (reads and writes),
    `peer_messages.py` (what peers say), then this file."""

    def register_kv_caches(
        self,
        caches: Mapping[str, Any],
        num_blocks: int | None = None,
        layer_groups: Mapping[str, int] | None = None,
        *,
        mamba: Sequence[MambaGroup] = (),
    ) -> None:
        """Register every layer's KV tensor with the transport and publish the handshake metadata.
        `layer_groups`: each layer's KV cache group (hybrid models); a layer not named is in group 0.
        `mamba`: the Mamba groups; each of their layers' state tensors is a region of its own (a page view
        of the hybrid allocator, or one per state), moved by block id with the attention layers."""
        self.layer_groups = dict(layer_groups or {})
        self.mamba = tuple(mamba)
        state_layers = mamba_layer_groups(self.mamba)
        for name, cache in caches.items():
            group = state_layers.get(name)
            regions = state_tensors(name, cache) if group is not None else [(name, cache)]
            for region_name, tensor in regions:
                region = self.transport.register(region_name, tensor)
                geometry = geometry_of(tensor, num_blocks)
                self.layers[region_name] = LayerDescriptor(name=region_name, geometry=geometry, region=region)
                if group is not None:
                    self.layer_groups[region_name] = group.group
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
                mamba=self.mamba,
            )
        )

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
                self.consumers.setdefault(save.transfer_id, consumer_of(save.peer))
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
                    block_groups=save.block_groups,
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
                renewal = LeaseRenew(transfer_ids=chunk, rank=rank, sender=self.config.rank_address)
                if self._tell_holders(peer, renewal):
                    self.counters["lease_renewals_sent"] += len(chunk)
                else:
                    self.counters["lease_renewals_not_sent"] += len(chunk)

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
                groups = t.map_event.block_groups if t.map_event is not None else None
                message = RemoteBlocks(
                    transfer_id=tid, block_ids=t.block_ids, sender=me, prompt_digest=digest, block_groups=groups
                )
                if not self._tell_holders(self.peers[tid], message):
                    # The producer will never learn where to write: waiting out the recv timeout helps nobody.
                    self.ledger.append(
                        Fail(ts=now, source=self.source, transfer_id=tid, reason=f"{REASON_NOT_SENT}: remote_blocks")
                    )
        self.poll(now)

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

    def _producing(self, request_id: ReqId) -> bool:
        """Whether `request_id` is a producer side of this rank whose finished notice must be kept: live, or
        decided in this step before the poll acted on its release (a write that failed at once in
        wait_for_save: its release is reported by the poll right after, and needs the notice)."""
        tid = self.index.get(request_id)
        if tid is None:
            return False
        t = self.state.transfers.get((self.source, tid))
        return t is not None and t.role == "producer"

    def poll(self, now: float) -> None:
        self.linker.adopt(now)
        events: list[Event] = []
        for dropped in self.channel.take_dropped(POLL_DROPS_MAX):
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
        self._take_messages(now, events)
        self._collect(now, events)
        if events:
            self.ledger.extend(events)
        self._resume_waiting(now)
        self._retry(now)
        self._tick(now)
        self._act_on_releases()
        self.ledger.maintain(now, retain_s=self.config.defer_timeout_s)

    def _tick(self, now: float) -> None:
        self.ledger.expire_due(now, transfer_timeout_s=self.config.transfer_timeout_s)

    def _act_on_releases(self) -> None:
        """What each decision obliges this rank to do: report it to vLLM and tell the peer."""
        c = self.config
        for release in self.ledger.take_releases():
            tid = release.transfer_id
            self.index.forget(release.request_id, tid)
            self._give_up(tid)
            self._confirming.pop(tid, None)
            self._relinking.pop(tid, None)
            self.waiting.drop(tid)
            self._step_saves.pop(tid, None)
            peer = self.peers.pop(tid, None)
            self.digests.pop(tid, None)
            self.consumers.pop(tid, None)
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

    def close(self) -> None:
        self.linker.close()
        self.channel.close()
        self.transport.close()
        self.ledger.close()
