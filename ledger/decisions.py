"""What the fold decides: a `Release` per transfer and side, and what vLLM is told of them (`VllmOutcome`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal, TypeAlias

import msgspec

from kvledger.ledger.events import FailCode, Mode, ReqId, Role, TransferId

Cause: TypeAlias = Literal["completed", "failed", "expired"]
CAUSES: tuple[Cause, ...] = ("completed", "failed", "expired")

Why: TypeAlias = Literal[
    "completed", "local_exceeds_remote", "deadline", "lease_missed", "expired_before_map"
] | FailCode  # fmt: skip
"""Why a side was released, a closed set: control flow reads this, never the words in `reason`. A
failure's `why` is its fail event's `code`."""

Key: TypeAlias = tuple[str, TransferId]
"""One side of a transfer: (source, transfer_id). Decisions are per key."""


class Release(msgspec.Struct, frozen=True, gc=False):
    """The blocks of one side of one transfer may be freed; taken exactly once.

    `seq`/`ts` are those of the event that completed the evidence. A consumer
    release for any cause but `completed` means the KV never fully arrived:
    `load_error` is then true and its blocks must not be decoded.
    """

    source: str
    transfer_id: TransferId
    request_id: ReqId
    role: Role
    mode: Mode
    block_ids: tuple[int, ...]
    cause: Cause
    seq: int
    ts: float
    reason: str
    """The evidence in words (a fail's own reason, the deadline that passed): for people and logs."""
    why: Why

    @property
    def load_error(self) -> bool:
        return self.role == "consumer" and self.cause != "completed"


class VllmOutcome(msgspec.Struct, kw_only=True):
    """What vLLM is told of releases, in its own names: the one translation, used by both connector halves.

    A producer's release frees its blocks (`finished_sending`); a consumer's ends its receive
    (`finished_recving`, failed ones included: vLLM's rule) and, when its KV did not arrive whole, fails
    it (`failed_recving`) and marks its blocks (`invalid_block_ids`, vLLM's load errors). Each half
    decides *when* vLLM hears of an entry (the scheduler at `update_connector_output`, a worker once
    vLLM says the request finished); what it hears is decided here alone.
    """

    finished_sending: set[ReqId] = msgspec.field(default_factory=set)
    finished_recving: set[ReqId] = msgspec.field(default_factory=set)
    failed_recving: set[ReqId] = msgspec.field(default_factory=set)
    invalid_block_ids: set[int] = msgspec.field(default_factory=set)

    @classmethod
    def of(cls, releases: Iterable[Release]) -> VllmOutcome:
        outcome = cls()
        for release in releases:
            outcome.add(release)
        return outcome

    def add(self, release: Release) -> None:
        if release.role == "producer":
            self.finished_sending.add(release.request_id)
        elif release.load_error:
            self.add_failed_recv(release.request_id, release.block_ids)
        else:
            self.finished_recving.add(release.request_id)

    def add_failed_recv(self, request_id: ReqId, block_ids: Iterable[int]) -> None:
        """A receive whose KV did not arrive whole: finished, failed, and its blocks not to be decoded."""
        self.finished_recving.add(request_id)
        self.failed_recving.add(request_id)
        self.invalid_block_ids.update(block_ids)

    def empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.failed_recving or self.invalid_block_ids)

    def merge(self, other: VllmOutcome) -> None:
        self.finished_sending |= other.finished_sending
        self.finished_recving |= other.finished_recving
        self.failed_recving |= other.failed_recving
        self.invalid_block_ids |= other.invalid_block_ids
