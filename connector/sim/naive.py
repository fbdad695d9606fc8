"""The naive baseline: MoRIIO's transfer bookkeeping before its fixes, fed the simulator's own observations.

It differs from the fold in exactly four rules, each a bug MoRIIO had:

1. No deferred-send deadline. `expire` events are ignored: a producer whose consumer
   never reads or releases (or a WRITE whose remote never became ready) holds its
   blocks for ever, and so does a consumer whose KV never arrives.
2. Unmapped acks are dropped with a warning. An ack or fail for a transfer not in its
   dict (a release that beat the producer worker's map) is logged and forgotten, so
   that transfer can no longer complete.
3. Send-queue-full is terminal. A `retryable` fail counts as a failure.
4. Failed transfers never release. After any fail the blocks stay held and the request
   is never reported finished, on that side.

Everything else is the fold's `completed` rule (release fan-in; sealed and every layer
written; read or recv acked), counted in plain dicts the way MoRIIO did.

Why feeding it the same observation stream is a fair comparison: each worker's log is
what that worker observed (maps from its metadata, completions and failures from its
transport, messages from its peer, its clock ticks), in the order it observed them.
The naive bookkeeping reads exactly those events of the same seed, so both take their
decisions from identical inputs and only the rules differ. Where the stream differs
from what a naive engine would have seen live, it differs in the naive side's favour:
it holds messages that exist only because the fold decided something the naive rules
would not have (a consumer released as failed still sends `release`, so the naive
producer sees a release it would never have got; retries after a send-queue-full
happened only because the connector retried; a read the producer answered "not held yet" because its worker
had not mapped the transfer yet is left out, since a naive producer served every read blindly). So the
naive figures are a lower bound
on what naive bookkeeping strands live under the same faults. Scheduler logs are not
fed: MoRIIO's scheduler frees blocks exactly when its workers report, so the workers'
naive decisions are the engine's.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from kvledger.connector.transports.base import Code
from kvledger.ledger.events import Ack, Drop, Event, Expire, Fail, Map, Mode, ReqId, Role, Seal, TransferId

log = logging.getLogger(__name__)

_NOT_HELD_YET = Code.NOT_HELD_YET.name


@dataclass
class NaiveTransfer:
    request_id: ReqId
    role: Role
    mode: Mode
    block_ids: tuple[int, ...]
    acks_expected: int
    release_acks: int = 0
    written_layers: set[int] = field(default_factory=set)
    expected: int | None = None
    arrived: bool = False
    failed: bool = False
    released: bool = False


class NaiveBookkeeping:
    """One worker's pre-fix bookkeeping: a dict of transfers, a release when the happy path completes."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.transfers: dict[TransferId, NaiveTransfer] = {}
        self.warnings: Counter[str] = Counter()
        self.released: list[TransferId] = []

    def observe(self, event: Event) -> None:
        if isinstance(event, Drop):
            return  # a refused message: no bookkeeping, naive or not, ever saw it
        tid = event.transfer_id
        if isinstance(event, Map):
            self.transfers[tid] = NaiveTransfer(
                event.request_id, event.role, event.mode, event.block_ids, event.acks_expected
            )
            return
        t = self.transfers.get(tid)
        if t is None:
            if not isinstance(event, Expire):
                self.warnings["dropped_unmapped"] += 1
                log.debug("%s: %s for unknown transfer %s dropped", self.source, type(event).__name__, tid)
            return
        if t.released or t.failed or isinstance(event, Expire):
            return  # rule 1: no deadlines; rule 4: a failed transfer is done for
        if isinstance(event, Fail):
            if event.retryable and event.reason.startswith(_NOT_HELD_YET):
                return  # a naive producer served this read without asking (see the module docstring)
            t.failed = True  # rules 3 and 4: retryable or not
            return
        if isinstance(event, Seal):
            t.expected = event.expected
        elif isinstance(event, Ack):
            if event.what == "release":
                t.release_acks += 1
            elif event.what == "write" and event.layers is not None:
                t.written_layers.update(event.layers)
            elif event.what in ("read", "recv"):
                t.arrived = True
        else:
            return
        if self._complete(t):
            t.released = True
            self.released.append(tid)

    @staticmethod
    def _complete(t: NaiveTransfer) -> bool:
        if t.role == "producer":
            if t.release_acks >= t.acks_expected:
                return True
            return t.mode == "write" and t.expected is not None and len(t.written_layers) >= t.expected
        return t.arrived

    def held(self) -> list[NaiveTransfer]:
        return [t for t in self.transfers.values() if not t.released]


@dataclass
class NaiveOutcome:
    leaked_blocks: int = 0
    hung_requests: int = 0
    dropped_acks: int = 0
    released: int = 0
    held_by_reason: Counter[str] = field(default_factory=Counter)


def run_naive(streams: dict[str, Iterable[Event]], lost: Collection[tuple[str, TransferId]] = ()) -> NaiveOutcome:
    """Feed each worker source's events, in log order, to its own naive bookkeeping; sum what is left held.

    `lost` names (source, transfer) sides in flight on an engine when it died: held by both bookkeepings
    at the end of that engine's log, they are counted for neither."""
    out = NaiveOutcome()
    for source, events in streams.items():
        book = NaiveBookkeeping(source)
        for event in events:
            book.observe(event)
        out.dropped_acks += book.warnings["dropped_unmapped"]
        out.released += len(book.released)
        for tid, t in book.transfers.items():
            if t.released or (source, tid) in lost:
                continue
            out.hung_requests += 1
            out.leaked_blocks += len(t.block_ids)
            out.held_by_reason["failed" if t.failed else "waiting (no deadline)"] += 1
    return out
