"""Observe mode's core: what a wrapped connector did, as plain data in, events in this process's ledger out.

Sans-IO like `connector/scheduler.py` (no vllm, no clock: `now` comes in) and
deciding nothing: the wrapped connector keeps every decision, and the ledger's
releases are only drained. What is recorded (scheduler side, one source
`<engine>/sched`):

- allocates for an external load (`update_state_after_alloc`, external tokens > 0, a consumer
  request): `map` consumer, deadline now + `transfer_timeout`;
- delays a producer's free (`request_finished` answers True): `map` producer, deadline now + its own
  hold time (NIXL: `kv_lease_duration`);
- frees at once a producer whose KV left before the finish (a synchronous saver such as
  `ExampleConnector`): `map` then `ack release`;
- names a producer in `finished_sending`: `ack release`, or `expire` (defer) when the connector reports
  requests freed by timeout in that output and the side's hold time had passed;
- names a consumer in `finished_recving`: `ack recv` (`fail` when also in `failed_recving`);
- reports load-error blocks of a live consumer (`invalid_block_ids`): `fail`;
- finishes a consumer still waiting: `fail` when aborted; `ack recv` when it ran (a synchronous load).

Recording must never disturb serving: every entry point is called through the
adapter's guard, so a problem here is logged and counted there, and the wrapped
connector's answer goes to vLLM unchanged.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from kvledger.connector.index import RequestIndex
from kvledger.connector.observe.keys import ParamsKeys
from kvledger.ledger.events import Ack, Event, Expire, Fail, Map, ReqId, Role, TransferId
from kvledger.ledger.ledger import Ledger
from kvledger.ledger.side import TransferState

log = logging.getLogger(__name__)

REASON_FAILED_RECVING = "failed_recving"
REASON_LOAD_ERROR_BLOCKS = "load_error_blocks"
REASON_REQUEST_ABORTED = "request_aborted_while_loading"


class Recorder:
    """One process's observer: appends to `ledger` what the wrapped connector (read through `keys`) did."""

    def __init__(self, ledger: Ledger, keys: ParamsKeys, *, hold_s: float, transfer_timeout_s: float) -> None:
        self.ledger = ledger
        self.keys = keys
        self.source = ledger.source
        self.state = ledger.state
        self.hold_s = hold_s
        self.transfer_timeout_s = transfer_timeout_s
        self.index = RequestIndex(ledger.log)
        self.counters: Counter[str] = Counter()

    # -- what passes through -------------------------------------------------

    def on_alloc(
        self,
        request_id: ReqId,
        params: Mapping[str, Any] | None,
        block_ids: tuple[int, ...],
        block_groups: tuple[int, ...] | None,
        num_external_tokens: int,
        now: float,
    ) -> None:
        """`update_state_after_alloc`; `params` as they were before the wrapped connector saw the call
        (NIXL and MoRIIO clear `do_remote_prefill` in it)."""
        if num_external_tokens <= 0 or not self.keys.consumer(params):
            return
        transfer_id = self.keys.consumer_transfer_id(params)
        if transfer_id is None:
            self.counters["params_without_transfer_id"] += 1
            return
        self._map(request_id, transfer_id, "consumer", block_ids, block_groups, now + self.transfer_timeout_s, now,
                  remote_block_ids=self.keys.remote_blocks(params), peer=self.keys.peer(params))  # fmt: skip

    def on_request_finished(
        self,
        request_id: ReqId,
        params: Mapping[str, Any] | None,
        finished_normally: bool,
        delayed: bool,
        block_ids: tuple[int, ...],
        block_groups: tuple[int, ...] | None,
        now: float,
    ) -> None:
        """`request_finished`: `delayed` is the wrapped connector's answer (True: it owns the free)."""
        mine = self._live(request_id)
        if mine is not None and mine.role == "consumer":
            # Still waiting at the end: aborted while loading, or a synchronous load (no finished_recving) that ran.
            if finished_normally:
                self._append(Ack(ts=now, source=self.source, transfer_id=mine.transfer_id, what="recv"), mine)
            else:
                self._append(Fail(ts=now, source=self.source, transfer_id=mine.transfer_id,
                                  reason=REASON_REQUEST_ABORTED), mine)  # fmt: skip
            return
        if not self.keys.producer(params):
            return
        transfer_id = self.keys.producer_transfer_id(request_id, params)
        if transfer_id is None:
            self.counters["params_without_transfer_id"] += 1
            return
        if delayed:
            self._map(request_id, transfer_id, "producer", block_ids, block_groups, now + self.hold_s, now)
        elif self.keys.sync_save and finished_normally:
            side = self._map(request_id, transfer_id, "producer", block_ids, block_groups, now, now)
            if side is not None:
                self._append(Ack(ts=now, source=self.source, transfer_id=transfer_id, what="release"), side)

    def on_output(
        self,
        finished_sending: Iterable[str],
        finished_recving: Iterable[str],
        failed_recving: Iterable[str],
        invalid_block_ids: Iterable[int],
        expired_reported: int | None,
        now: float,
    ) -> None:
        """`update_connector_output`, as vLLM acts on it (after the wrapped connector's rewrite).
        `expired_reported`: requests the wrapped connector says it freed by timeout in this output
        (None when it reports no such figure: a passed hold time alone then says expired)."""
        failed = set(failed_recving)
        invalid = set(invalid_block_ids)
        if invalid and not invalid.isdisjoint(self.state.held.get(self.source, ())):
            for held in list(self.state.live.values()):
                if held.source == self.source and held.role == "consumer" and invalid.intersection(held.block_ids):
                    self._append(Fail(ts=now, source=self.source, transfer_id=held.transfer_id,
                                      reason=REASON_LOAD_ERROR_BLOCKS), held)  # fmt: skip
        for request_id in sorted(set(finished_recving) | failed):
            side = self._live(ReqId(request_id))
            if side is None or side.role != "consumer":
                continue
            if request_id in failed:
                reason = REASON_FAILED_RECVING
                event: Event = Fail(ts=now, source=self.source, transfer_id=side.transfer_id, reason=reason)
            else:
                event = Ack(ts=now, source=self.source, transfer_id=side.transfer_id, what="recv")
            self._append(event, side)
        expired_left = expired_reported
        sent = [s for r in sorted(finished_sending) if (s := self._live(ReqId(r))) is not None and s.role == "producer"]
        for side in sorted(sent, key=lambda s: s.deadline or 0.0):
            overdue = side.deadline is not None and now >= side.deadline
            if overdue and (expired_left is None or expired_left > 0):
                if expired_left is not None:
                    expired_left -= 1
                self._append(Expire(ts=now, source=self.source, transfer_id=side.transfer_id, deadline="defer"), side)
            else:
                self._append(Ack(ts=now, source=self.source, transfer_id=side.transfer_id, what="release"), side)
        self.ledger.take_releases()  # the wrapped connector frees; the fold's releases are only its record
        self.ledger.maintain(now, retain_s=self.hold_s + self.transfer_timeout_s)

    # -- helpers ---------------------------------------------------------------

    def _live(self, request_id: ReqId) -> TransferState | None:
        transfer_id = self.index.get(request_id)
        if transfer_id is None:
            return None
        side = self.state.live.get((self.source, transfer_id))
        return side if side is not None and side.request_id == request_id else None

    def _map(
        self,
        request_id: ReqId,
        transfer_id: TransferId,
        role: Role,
        block_ids: tuple[int, ...],
        block_groups: tuple[int, ...] | None,
        deadline: float,
        now: float,
        *,
        remote_block_ids: tuple[int, ...] | None = None,
        peer: str | None = None,
    ) -> TransferState | None:
        """Record the side; a used transfer id is recorded too (the fold refuses it: an id_reuse finding)."""
        groups = block_groups if block_groups and len(block_groups) > 1 else None
        event = Map(ts=now, source=self.source, transfer_id=transfer_id, request_id=request_id, role=role,
                    mode=self.keys.mode, block_ids=block_ids, deadline=deadline, remote_block_ids=remote_block_ids,
                    peer=peer, block_groups=groups)  # fmt: skip
        self.ledger.append(event)
        side = self.state.live.get((self.source, transfer_id))
        if side is None or side.request_id != request_id:
            self.counters["transfer_id_reused"] += 1
            self.index.forget(request_id, transfer_id)
            return None
        return side

    def _append(self, event: Event, side: TransferState) -> None:
        request_id = side.request_id
        if self.ledger.append(event) is not None and request_id is not None:
            self.index.forget(request_id, side.transfer_id)
