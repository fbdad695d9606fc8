"""The scheduler half of the connector core: vLLM's scheduler-side hooks as plain data in, decisions out.

Sans-IO: no sockets, no threads, no clock (`now` comes in). Every observation
is appended to this process's ledger (`<engine>/sched`) and every answer is read
from its fold: blocks are held exactly while the fold says a transfer is live,
and `finished_sending` / `finished_recving` are the releases the fold decided.
What crosses to the workers is the per-step `StepMetadata` (an outbox, emptied
by `build_meta`), never a second copy of transfer state.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Iterable
from typing import Any

import msgspec

from kvledger.connector.config import ConnectorConfig
from kvledger.connector.index import RequestIndex
from kvledger.connector.limits import LEASES_TRACKED_MAX
from kvledger.connector.maps import side_map
from kvledger.connector.metadata import (
    AbortItem,
    FailItem,
    LeaseItem,
    PeerRef,
    RecvItem,
    SaveItem,
    SendItem,
    StepMetadata,
)
from kvledger.connector.params import ConsumerParams, TransferParams
from kvledger.connector.reasons import (
    REASON_ABORTED_BEFORE_ALLOCATION,
    REASON_PEER_NOT_ALLOWED,
    REASON_WORKER_RECV_FAILED,
)
from kvledger.connector.store import abandon_inherited
from kvledger.ledger.decisions import Release, VllmOutcome
from kvledger.ledger.events import Ack, Event, Fail, Map, ReqId, Role, TransferId
from kvledger.ledger.ledger import Ledger

log = logging.getLogger(__name__)


class WorkerOutcome(VllmOutcome, kw_only=True):
    """What the scheduler tells vLLM after folding the workers' output and its clock tick, and the releases
    decided on the way (for callers that keep books of them: the simulator, tests)."""

    releases: list[Release] = msgspec.field(default_factory=list)


class SchedulerCore:
    def __init__(self, config: ConnectorConfig, ledger: Ledger) -> None:
        self.config = config
        self.ledger = ledger
        self.source = ledger.source
        self.state = ledger.state
        self._log = ledger.log
        """Every event this core appends is built with its seq, `self._log.next_seq` read as it is built:
        exact, because this core is its ledger's only appender (vLLM calls the scheduler hooks from one
        thread), and it spares the log a copy of each event to stamp it."""
        self._producer_hold_s = config.producer_hold_s(scheduler=True)
        self._consumer_params = ConsumerParams(config.address).__call__
        """Bound once: calling the instance would look `__call__` up and bind it on every request_finished."""
        self.index = RequestIndex()
        """Told of every map by `_append_map`: this core is its ledger's only appender of maps."""
        self.counters: Counter[str] = Counter()
        self._step = StepMetadata()
        self._unreported = VllmOutcome()
        """Releases vLLM has yet to hear of: a producer's decided outside update_connector_output (a tick,
        a refused map) is reported at the next one."""
        self._handed: set[ReqId] = set()
        """Consumer requests whose failure this half decided and handed to the workers to report: their
        report passes through update_connector_output as the workers made it."""
        self._leases: dict[TransferId, PeerRef] = {}
        """Consumer: waiting transfers whose producer's hold this half renews (until this side's decision, or
        the request ends), bounded by LEASES_TRACKED_MAX."""
        self._lease_due: deque[tuple[float, TransferId]] = deque()
        """(next renewal time, transfer) in time order: every lease has the same interval, so a FIFO is
        ordered; entries of transfers no longer renewed are skipped when they come up."""
        inherited = abandon_inherited(ledger)  # reopened after a restart: those requests died with the process
        if inherited:
            self.counters["inherited_transfers_failed"] = inherited

    def set_generations(self, generations: dict[int, int]) -> None:
        """This engine's workers' generations by TP rank (vLLM hands them over once the workers registered
        their KV caches): from now on the params handed to consumers name them, so a consumer whose link to a
        rank is from another life of it handshakes again before it reads. A rank missing names none."""
        ranks = self.config.tp_size
        lives = tuple(generations.get(rank, 0) for rank in range(ranks))
        address = msgspec.structs.replace(self.config.address, generations=lives if any(lives) else ())
        self._consumer_params = ConsumerParams(address).__call__

    # -- the peer allow-list ------------------------------------------------

    def _allowed_peer(self, peer: PeerRef | None) -> bool:
        return peer is not None and self.config.find_peer(peer.host, peer.handshake_port, peer.notify_port) is not None

    def _refused(self, transfer_id: TransferId) -> bool:
        """A transfer id is single-use per side: this side mapped it before (live, decided or forgotten)."""
        return self.state.was_mapped((self.source, transfer_id))

    def _record_refused(self, request_id: ReqId, params: TransferParams, role: Role, now: float) -> None:
        """A second request naming a used transfer id: its map is recorded so that the fold refuses it
        (an id_reuse finding naming this request) and holds nothing for it."""
        self.counters["transfer_id_reused"] += 1
        self._record_blockless_map(request_id, params, role, now)
        # No transfer starts, so no release will ever drop the index entry the map made.
        self.index.forget(request_id, params.transfer_id)

    def _append_map(self, event: Map) -> None:
        """Append a map and index its request (entries go when the release is routed, `_route`)."""
        self.ledger.append(event)
        self.index.put(event.request_id, event.transfer_id)

    def _record_blockless_map(self, request_id: ReqId, params: TransferParams, role: Role, now: float) -> None:
        """A side that holds no blocks (refused, or ended before its allocation): the log says what happened."""
        self._append_map(
            side_map(
                seq=self._log.next_seq,
                ts=now,
                source=self.source,
                transfer_id=params.transfer_id,
                request_id=request_id,
                role=role,
                mode=self.config.mode,
                block_ids=(),
                deadline=now,
                peer=params.peer(),
            )
        )

    # -- hooks ----------------------------------------------------------------

    def matched_tokens(
        self, params: TransferParams | None, num_prompt_tokens: int, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """get_num_new_matched_tokens: side-effect free. Loads are asynchronous in both modes (the
        request waits in WAITING_FOR_REMOTE_KVS). The answer is what the remote KV covers: the whole
        prompt beyond what vLLM holds, as vLLM's own connectors answer (vLLM itself recomputes the last
        prompt token of a whole-prompt hit, so that the next one can be sampled). Answering one token
        less undercounted hits, and when the prompt ends one token into a block it allocated one block
        fewer than the producer filled, so the tail pairing of `layout.pair_blocks` shifted every block.

        A re-ask (vLLM preempted the request, or recomputes it after a failed load) is answered from
        the request's own params: `on_alloc` had them say the remote KV was taken, as vLLM's NIXL and
        MoRIIO connectors do, so the request computes locally. A transfer id this side used before is
        never loaded again, whoever asks."""
        if self.config.role != "consumer" or params is None or not params.do_remote_prefill:
            return 0, False
        if self.config.mode == "read" and params.remote_block_ids is None:
            return 0, False
        if self._refused(params.transfer_id):
            return 0, False
        if not self._allowed_peer(params.peer()):
            return 0, False  # known before the load: the request prefills locally (on_alloc records why)
        count = num_prompt_tokens - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def on_new_request(self, request_id: ReqId, params: TransferParams | None, now: float) -> None:
        """on_new_request (vLLM adds a request): a consumer request that will load remote KV renews its
        producer's hold every kv_lease_duration / 6 from now until this side decides (NIXL's heartbeats), so
        a decode backlog longer than defer_timeout finds the KV still held. Sans-IO: the renewals due go to
        the workers in the step's metadata, and the workers send them without waiting."""
        c = self.config
        if c.role != "consumer" or not c.leases or params is None or not params.do_remote_prefill:
            return
        tid = params.transfer_id
        if tid in self._leases or self._refused(tid):
            return
        peer = params.peer()
        if peer is None or not self._allowed_peer(peer):
            return
        if len(self._leases) >= LEASES_TRACKED_MAX:
            self.counters["leases_untracked"] += 1  # it may find its producer expired: a refused read, a recompute
            return
        self._leases[tid] = peer
        self._lease_due.append((now + c.lease_renew_interval_s, tid))

    def _renew_leases(self, now: float) -> None:
        due, leases, interval = self._lease_due, self._leases, self.config.lease_renew_interval_s
        while due and due[0][0] <= now:
            _, tid = due.popleft()
            peer = leases.get(tid)
            if peer is None:
                continue
            self._step.lease.append(LeaseItem(transfer_id=tid, peer=peer))
            due.append((now + interval, tid))
        if not leases:
            due.clear()

    def on_alloc(
        self,
        request_id: ReqId,
        params: TransferParams | None,
        block_ids: Iterable[int],
        num_external_tokens: int,
        now: float,
        *,
        prompt_digest: str | None = None,
        block_groups: tuple[int, ...] | None = None,
    ) -> bool:
        """update_state_after_alloc: the consumer maps the transfer onto its freshly allocated blocks.
        `prompt_digest` (WRITE) goes with remote_blocks, for the producer to check it holds this prompt.

        Returns True when the request's params must from now on say that its remote KV was taken
        (`do_remote_prefill` false; see `params.remote_prefill_taken`): only one transfer per request."""
        if self.config.role != "consumer" or params is None or not params.do_remote_prefill:
            return False
        tid = params.transfer_id
        if self.index.get(request_id) == tid:
            return True  # the second call for an async load, from a caller that kept the params as they were
        if self._refused(tid):
            self._record_refused(request_id, params, "consumer", now)
            return True
        if num_external_tokens <= 0:
            # Nothing to load (vLLM holds every token, or the prompt is one token long): the producer
            # holds blocks for nobody, so it is told at once, as for a request aborted before allocation.
            self._consumer_aborted(request_id, params, now)
            return True
        peer = params.peer()
        blocks = tuple(block_ids)
        self._append_map(
            side_map(
                seq=self._log.next_seq,
                ts=now,
                source=self.source,
                transfer_id=params.transfer_id,
                request_id=request_id,
                role="consumer",
                mode=self.config.mode,
                block_ids=blocks,
                remote_block_ids=params.remote_block_ids,
                peer=peer,
                deadline=now + self.config.recv_abort_timeout_s,
                block_groups=block_groups,
                remote_block_groups=params.remote_block_groups,
            )
        )
        if peer is None or not self._allowed_peer(peer):
            self._refuse_peer(params.transfer_id, peer, now)
            self._route(self.ledger.take_releases(), reported=False)
            return True
        self._step.recv.append(
            RecvItem(
                transfer_id=params.transfer_id,
                request_id=request_id,
                mode=self.config.mode,
                block_ids=blocks,
                remote_block_ids=params.remote_block_ids,
                peer=peer,
                deadline=now + self.config.recv_abort_timeout_s,
                prompt_digest=prompt_digest,
                block_groups=block_groups,
                remote_block_groups=params.remote_block_groups,
            )
        )
        return True

    def on_save(
        self,
        request_id: ReqId,
        params: TransferParams | None,
        block_ids: Iterable[int],
        now: float,
        *,
        prompt_digest: str | None = None,
        block_groups: tuple[int, ...] | None = None,
    ) -> None:
        """Producer, WRITE: the request's prompt completes in this step; its workers write every layer
        (only to a consumer whose remote_blocks carry the same `prompt_digest`, where both have one), each
        from the blocks of its own KV cache group (`block_groups`: the counts, None for one group)."""
        if self.config.role != "producer" or self.config.mode != "write":
            return
        if params is None or not params.do_remote_decode or self._refused(params.transfer_id):
            return  # a used transfer id: request_finished refuses it, and nothing is written for it
        peer = params.peer()
        self._step.save.append(
            SaveItem(
                transfer_id=params.transfer_id,
                request_id=request_id,
                block_ids=tuple(block_ids),
                peer=peer if self._allowed_peer(peer) else None,
                deadline=now + self.config.defer_timeout_s,
                prompt_digest=prompt_digest,
                block_groups=block_groups,
            )
        )

    def on_request_finished(
        self,
        request_id: ReqId,
        params: TransferParams | None,
        block_ids: Iterable[int],
        now: float,
        *,
        block_groups: tuple[int, ...] | None = None,
    ) -> tuple[bool, dict[str, Any] | None]:
        """request_finished: True while the producer keeps blocks for a remote decode (in every KV cache
        group: `block_ids` is their concatenation, `block_groups` their counts, None for one group)."""
        if params is None:
            return False, None
        if self.config.role == "producer":
            return self._producer_finished(request_id, params, tuple(block_ids), now, block_groups)
        self._leases.pop(params.transfer_id, None)
        if params.do_remote_prefill and not self._refused(params.transfer_id):
            self._consumer_aborted(request_id, params, now)  # ended before its first allocation
        # A mapped consumer request: vLLM itself keeps its blocks until finished_recving.
        return False, None

    def _producer_finished(
        self,
        request_id: ReqId,
        params: TransferParams,
        blocks: tuple[int, ...],
        now: float,
        block_groups: tuple[int, ...] | None,
    ) -> tuple[bool, dict[str, Any] | None]:
        if not params.do_remote_decode or not blocks:
            return False, None
        if self._refused(params.transfer_id):
            # A used transfer id: vLLM frees the blocks now and the consumer gets no params (it prefills
            # locally). Holding them would strand them: the fold keeps no side for a refused map.
            self._record_refused(request_id, params, "producer", now)
            return False, None
        config = self.config
        peer = params.peer()
        self._append_map(
            side_map(
                seq=self._log.next_seq,
                ts=now,
                source=self.source,
                transfer_id=params.transfer_id,
                request_id=request_id,
                role="producer",
                mode=config.mode,
                block_ids=blocks,
                peer=peer,
                deadline=now + self._producer_hold_s,  # ConnectorConfig.producer_deadline, its hold taken once
                block_groups=block_groups,
            )
        )
        if config.mode == "read":
            self._step.send.append(
                SendItem(
                    transfer_id=params.transfer_id,
                    request_id=request_id,
                    block_ids=blocks,
                    deadline=now + config.defer_timeout_s,
                    block_groups=block_groups,
                )
            )
            return True, self._consumer_params(params.transfer_id, blocks, block_groups=block_groups)
        if not self._allowed_peer(peer):
            self._refuse_peer(params.transfer_id, peer, now)
        return True, {"transfer_id": params.transfer_id, "remote_engine_id": config.engine_id}

    def _consumer_aborted(self, request_id: ReqId, params: TransferParams, now: float) -> None:
        # Recorded as a failed, blockless side so that the log says what happened and replay agrees.
        tid = params.transfer_id
        peer = params.peer()
        self._leases.pop(tid, None)
        self._record_blockless_map(request_id, params, "consumer", now)
        self.ledger.append(
            Fail(
                seq=self._log.next_seq,
                ts=now,
                source=self.source,
                transfer_id=tid,
                reason=REASON_ABORTED_BEFORE_ALLOCATION,
                code="aborted_before_allocation",
            )
        )
        if peer is not None and self._allowed_peer(peer):
            self._step.abort.append(AbortItem(transfer_id=tid, request_id=request_id, peer=peer))

    def build_meta(self, now: float | None = None) -> StepMetadata:
        """build_connector_meta: tick (vLLM calls this every step of a non-empty engine, idle or not, while
        update_connector_output waits for a worker report), then hand this step's outbox to the workers."""
        if now is not None:
            self.tick(now)
            releases = self.ledger.take_releases()
            if releases:
                self._route(releases, reported=False)
            if self._lease_due:
                self._renew_leases(now)
        step, self._step = self._step, StepMetadata()
        return step

    def on_worker_output(
        self,
        finished_sending: Iterable[ReqId],
        finished_recving: Iterable[ReqId],
        failed_recving: Iterable[ReqId],
        now: float,
    ) -> WorkerOutcome:
        """update_connector_output, the clock tick: fold the workers' reports and expire what is due."""
        events: list[Event] = []
        source, transfer_of = self.source, self.index.get
        # Each event is built with the seq the log will give it (see `_log`): nothing else appends
        # between here and the extend below.
        seq = self._log.next_seq
        # vLLM hands over sets: sorting makes the log's order independent of string hashing, so
        # the same run gives the same log byte for byte in every process.
        failed_set = set(failed_recving)
        out = WorkerOutcome()
        if self._handed:
            for request_id in sorted(set(finished_recving) & self._handed):
                self._handed.discard(request_id)
                out.finished_recving.add(request_id)
                if request_id in failed_set:
                    out.failed_recving.add(request_id)
        for request_id in sorted(failed_set):
            if request_id in out.finished_recving:
                continue
            tid = transfer_of(request_id)
            if tid is None:
                self.counters["unknown_request"] += 1
                continue
            events.append(
                Fail(seq=seq + len(events), ts=now, source=source, transfer_id=tid, reason=REASON_WORKER_RECV_FAILED)
            )
        for request_id in sorted(finished_recving):
            tid = transfer_of(request_id)
            if request_id in failed_set or request_id in out.finished_recving:
                continue
            if tid is None:
                self.counters["unknown_request"] += 1
                continue
            events.append(Ack(seq=seq + len(events), ts=now, source=source, transfer_id=tid, what="recv"))
        for request_id in sorted(finished_sending):
            tid = transfer_of(request_id)
            if tid is None:
                self.counters["unknown_request"] += 1
                continue
            events.append(Ack(seq=seq + len(events), ts=now, source=source, transfer_id=tid, what="release"))
        ledger = self.ledger
        if events:
            ledger.extend(events)
        self._route(ledger.take_releases(), reported=True, out=out)
        self.tick(now)
        self._route(ledger.take_releases(), reported=False, out=out)
        return out

    def tick(self, now: float) -> None:
        """Append `expire` for every deadline that has passed (the only place time decides)."""
        self.ledger.expire_due(now, transfer_timeout_s=self.config.transfer_timeout_s)
        # Late events stay visible (as findings) for a defer timeout after the decision.
        self.ledger.maintain(now, retain_s=self.config.defer_timeout_s)

    def _route(self, releases: list[Release], *, reported: bool, out: WorkerOutcome | None = None) -> None:
        """Where each decision reaches vLLM. A producer's: finished_sending in `out` (or the next one). A
        consumer's: as `out`'s finished/failed receive when it answers a worker's report (`reported`);
        decided here (a refused peer, a deadline) it goes to the workers in the next metadata, for them to
        report: vLLM reads failed_recving and load errors from the workers before update_connector_output."""
        if not releases and (out is None or self._unreported.empty()):
            return  # most steps: nothing decided, nothing waiting to be heard of
        # Heard of now (`out`) or at the next update_connector_output (`_unreported`, merged into it then).
        outcome = self._unreported if out is None else out
        forget = self.index.forget
        for release in releases:
            forget(release.request_id, release.transfer_id)
            if out is not None:
                out.releases.append(release)
            if release.role == "consumer":
                if self._leases:
                    self._leases.pop(release.transfer_id, None)  # decided: nothing more to wait for
                if release.why == "aborted_before_allocation":
                    continue  # vLLM already freed the request: reporting it would be a KeyError there
                if not reported:
                    self._handed.add(release.request_id)
                    self._step.failed.append(
                        FailItem(
                            transfer_id=release.transfer_id,
                            request_id=release.request_id,
                            block_ids=release.block_ids,
                            reason=f"{release.cause}: {release.reason}",
                        )
                    )
                    continue
            outcome.add(release)
        if out is not None and not self._unreported.empty():
            out.merge(self._unreported)
            self._unreported = VllmOutcome()

    def _refuse_peer(self, transfer_id: TransferId, peer: PeerRef | None, now: float) -> None:
        """A peer outside the allow-list (or none named): the side fails at once, naming it."""
        self.counters["peer_not_allowed"] += 1
        reason = f"{REASON_PEER_NOT_ALLOWED}: {peer.label if peer else 'none named'}"
        self.ledger.append(
            Fail(seq=self._log.next_seq, ts=now, source=self.source, transfer_id=transfer_id, reason=reason)
        )

    # -- queries --------------------------------------------------------------

    def has_pending_block_frees(self) -> bool:
        """A producer holds blocks for a remote decode (the engine must keep stepping to free them)."""
        return self.config.role == "producer" and bool(self.state.live)

    def has_pending_push_work(self) -> bool:
        return self.config.role == "producer" and self.config.mode == "write" and bool(self.state.live)

    def stats(self) -> dict[str, Any]:
        state = self.state
        out: dict[str, Any] = {
            "live": len(state.live),
            "blocks_held": state.blocks_held,
            "released": dict(state.releases_by_cause),
            "leases_renewed_for": len(self._leases),
            "events": self._log.next_seq - 1,
        }
        if self.counters:
            out.update({f"count_{k}": v for k, v in self.counters.items()})
        return out
