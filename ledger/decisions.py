"""What the fold decides: a `Release` per transfer and side, and vLLM's views of them."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal, TypeAlias

import msgspec

from ledger.events import FailCode, Mode, ReqId, Role, TransferId

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


def finished_sending(releases: Iterable[Release]) -> set[ReqId]:
    """Producer request ids whose blocks vLLM may free (its `finished_sending`)."""
    return {r.request_id for r in releases if r.role == "producer"}


def finished_recving(releases: Iterable[Release]) -> set[ReqId]:
    """Consumer request ids done receiving, failed ones included (vLLM's rule)."""
    return {r.request_id for r in releases if r.role == "consumer"}


def failed_recving(releases: Iterable[Release]) -> set[ReqId]:
    """Consumer request ids whose KV did not arrive whole."""
    return {r.request_id for r in releases if r.load_error}


def load_error_blocks(releases: Iterable[Release]) -> set[int]:
    """Block ids for vLLM's `get_block_ids_with_load_errors`."""
    return {b for r in releases if r.load_error for b in r.block_ids}
