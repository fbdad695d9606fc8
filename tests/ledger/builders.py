"""Event builders for tests: one `Side` per source, stamping seq and ts in order."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvledger.ledger.events import Ack, Drop, Event, Expire, Fail, Map, ReqId, Schedule, Seal, TransferId


class Side:
    """Makes the events one source appends, numbering them 1, 2, 3, ... with a fake clock."""

    def __init__(self, source: str, *, start_ts: float = 1000.0, step_s: float = 0.01) -> None:
        self.source = source
        self.seq = 0
        self.ts = start_ts
        self.step_s = step_s

    def _next(self, ts: float | None) -> dict[str, Any]:
        self.seq += 1
        self.ts = ts if ts is not None else self.ts + self.step_s
        return {"seq": self.seq, "ts": self.ts, "source": self.source}

    def map(self, tid: str, req: str, role: str = "producer", mode: str = "read", *,
            blocks: tuple[int, ...] = (1, 2, 3), remote: tuple[int, ...] | None = None,
            acks: int = 1, deadline: float | None = None, ts: float | None = None) -> Map:  # fmt: skip
        env = self._next(ts)
        return Map(**env, transfer_id=TransferId(tid), request_id=ReqId(req), role=role, mode=mode,  # type: ignore[arg-type]
                   block_ids=blocks, remote_block_ids=remote, acks_expected=acks,
                   deadline=deadline if deadline is not None else env["ts"] + 60.0)  # fmt: skip

    def schedule(self, tid: str, layers: tuple[int, ...] | None = None, *, op: str = "read",
                 attempt: int = 0, deferred: bool = False, ts: float | None = None) -> Schedule:  # fmt: skip
        return Schedule(**self._next(ts), transfer_id=TransferId(tid), op=op, layers=layers,  # type: ignore[arg-type]
                        attempt=attempt, deferred=deferred)  # fmt: skip

    def seal(self, tid: str, expected: int, *, ts: float | None = None) -> Seal:
        return Seal(**self._next(ts), transfer_id=TransferId(tid), expected=expected)

    def ack(self, tid: str, what: str, layers: tuple[int, ...] | None = None, *, rank: int = 0,
            ts: float | None = None) -> Ack:  # fmt: skip
        return Ack(**self._next(ts), transfer_id=TransferId(tid), what=what, layers=layers, rank=rank)  # type: ignore[arg-type]

    def lease(self, tid: str, until: float, *, ts: float | None = None) -> Ack:
        """A lease renewal: the consumer asks the producer to hold its blocks until `until`."""
        return Ack(**self._next(ts), transfer_id=TransferId(tid), what="lease", until=until)

    def fail(self, tid: str, reason: str = "boom", *, retryable: bool = False, code: str = "error",
             ts: float | None = None) -> Fail:  # fmt: skip
        return Fail(**self._next(ts), transfer_id=TransferId(tid), reason=reason, retryable=retryable, code=code)  # type: ignore[arg-type]

    def drop(self, tid: str, message: str = "release", reason: str = "bad_mac", *, ts: float | None = None) -> Drop:
        return Drop(**self._next(ts), transfer_id=TransferId(tid), message=message, sender="127.0.0.1", reason=reason)

    def expire(self, tid: str, deadline: str = "defer", *, ts: float | None = None) -> Expire:
        return Expire(**self._next(ts), transfer_id=TransferId(tid), deadline=deadline)  # type: ignore[arg-type]


def releases_of(events: list[Event]) -> list[Any]:
    from kvledger.ledger.fold import fold_all

    return fold_all(events)[1]


def apply_raising_on(transfer_id: str) -> Callable[[Any, Event], object]:
    """`LedgerState.apply` that raises for the events of `transfer_id` (a fold bug, should there ever be one):
    monkeypatched in, it shows what a caller does with an event the fold raises on."""
    from kvledger.ledger.fold import LedgerState

    real_apply = LedgerState.apply

    def apply(self: Any, event: Event) -> object:
        if event.transfer_id == transfer_id:
            raise RuntimeError("a fold bug")
        return real_apply(self, event)

    return apply


class ServiceFold:
    """The containers the service hands `kvledger.ledger.projection.fold_rows`, folding events as stored rows with the
    next cursors, and what it was told of each release (`told`: release, seconds held)."""

    def __init__(self, holding: Any = None) -> None:
        from kvledger.ledger.advice import LatencyRecorder
        from kvledger.ledger.events import KINDS
        from kvledger.ledger.fold import LedgerState
        from kvledger.ledger.series import HoldingSeries

        self.state = LedgerState()
        self.by_kind = dict.fromkeys(KINDS, 0)
        self.last_ts: dict[str, float] = {}
        self.order: list[Any] = []
        self.by_request: dict[str, Any] = {}
        self.holding = holding if holding is not None else HoldingSeries()
        self.latency = LatencyRecorder()
        self.told: list[tuple[Any, float]] = []
        self.cursor = 0

    def fold(self, events: list[Event]) -> list[tuple[int, Event, Exception]]:
        """Fold `events` as the next rows; the rows whose event raised, with the error."""
        from kvledger.ledger.projection import fold_rows

        rows = [(self.cursor + i, e) for i, e in enumerate(events, 1)]
        self.cursor += len(events)
        return fold_rows(
            self.state, rows, self.by_kind, self.last_ts, self.order, self.by_request, self.holding,
            self.latency, lambda release, held_s: self.told.append((release, held_s)),
        )  # fmt: skip
