"""What stays of a decided transfer side once compacted: all that a later event or a merged audit can
still ask of it, packed small.

A later event for the side (late, a duplicate or a reused id) is judged on the side rebuilt from
this, with the same evidence, request, blocks and decision as the whole side had; a merged audit
reads the decision and the consumer's arrival from it (premature_release). The map's peer and remote
block ids are not kept: no decision or finding reads them once the side is decided.

Numbers and block ids are packed into one bytes object: a float or a large int is an object of its
own (24-28 bytes) and a freshly decoded block id one more, so a tombstone of Python fields cost
about 650 bytes in a replay, packed about 450 (measured with 8 blocks a side).
"""

from __future__ import annotations

import math
import struct

import msgspec

from kvledger.ledger.decisions import Cause, Release, Why
from kvledger.ledger.events import Map, Mode, ReqId, Role, TransferId
from kvledger.ledger.transfer_state import TransferState

_NUMBERS = struct.Struct("<ddddqqqqq")
"""deadline, map ts, decision ts, arrived ts (NaN: none), acks expected, map seq, decision seq,
arrived seq, events; then the block ids, signed 64-bit little-endian (`_packer`)."""


class Compacted(msgspec.Struct, frozen=True, gc=False, array_like=True):
    request_id: ReqId
    role: Role
    mode: Mode
    cause: Cause
    reason: str
    why: Why
    packed: bytes
    """`_NUMBERS`, then the block ids as signed 64-bit ints."""
    found: int = 0
    """The kinds of evidence the side had (`FOUND_*` bits): the seqs go, but a side recalled by another late,
    duplicate, over-ack or reused-id event is known to have had that finding, so it is not counted as found
    again (`found_by_code`, ledger/indexes.py)."""


FOUND_LATE, FOUND_DUPLICATE, FOUND_OVER_ACK, FOUND_REUSE = 1, 2, 4, 8


def found_bits(t: TransferState) -> int:
    """The `FOUND_*` bits of the evidence `t` holds (0 nearly always)."""
    return (
        (FOUND_LATE if t.late_seqs is not None else 0)
        | (FOUND_DUPLICATE if t.duplicate_seqs is not None else 0)
        | (FOUND_OVER_ACK if t.over_ack_seqs is not None else 0)
        | (FOUND_REUSE if t.reuse_seqs is not None else 0)
    )


def with_found(tomb: Compacted, found: int) -> Compacted:
    """`tomb` remembering the `found` bits of its side (`found_bits`)."""
    return msgspec.structs.replace(tomb, found=found)


def mark_found(t: TransferState, found: int) -> None:
    """`t`, rebuilt from a tombstone of `found` bits, with an empty list of seqs for each kind it had: no
    finding until a new event of that kind comes, and that one is not found for the first time."""
    if found & FOUND_LATE:
        t.late_seqs = []
    if found & FOUND_DUPLICATE:
        t.duplicate_seqs = []
    if found & FOUND_OVER_ACK:
        t.over_ack_seqs = []
    if found & FOUND_REUSE:
        t.reuse_seqs = []


def compacted(m: Map, decision: Release, arrived_ts: float | None, arrived_seq: int, events: int) -> Compacted:
    """Raises OverflowError or struct.error for an integer past 64 bits (no valid event has one: the
    fold then keeps that side whole)."""
    blocks = m.block_ids
    packed = _packer(len(blocks)).pack(
        m.deadline, m.ts, decision.ts, math.nan if arrived_ts is None else arrived_ts,
        m.acks_expected, m.seq, decision.seq, arrived_seq, events, *blocks,
    )  # fmt: skip
    return Compacted(m.request_id, m.role, m.mode, decision.cause, decision.reason, decision.why, packed)


_PACKERS: dict[int, struct.Struct] = {}
"""`_NUMBERS` and n block ids as one format, by n (a model's requests have a few block counts)."""
_PACKERS_MAX = 1024
"""Block counts whose format is kept (past it the cache starts again: bounded, and a format is cheap)."""


def _packer(blocks: int) -> struct.Struct:
    """`_NUMBERS` and `blocks` signed 64-bit block ids as one format: packed (or unpacked) by one call, where
    packing the numbers and then the ids as an array took three and a concatenation."""
    packer = _PACKERS.get(blocks)
    if packer is None:
        if len(_PACKERS) >= _PACKERS_MAX:
            _PACKERS.clear()
        packer = _PACKERS[blocks] = struct.Struct(f"{_NUMBERS.format}{blocks}q")
    return packer


class Unpacked(msgspec.Struct, frozen=True, gc=False):
    """A tombstone's numbers, read back."""

    deadline: float
    map_ts: float
    decision_ts: float
    arrived_ts: float | None
    acks_expected: int
    map_seq: int
    decision_seq: int
    arrived_seq: int
    events: int
    block_ids: tuple[int, ...]


def unpack(c: Compacted) -> Unpacked:
    values = _packer((len(c.packed) - _NUMBERS.size) // 8).unpack(c.packed)
    deadline, map_ts, decision_ts, arrived_ts, acks, map_seq, decision_seq, arrived_seq, events = values[:9]
    blocks = values[9:]
    arrived = None if math.isnan(arrived_ts) else arrived_ts
    return Unpacked(deadline, map_ts, decision_ts, arrived, acks, map_seq, decision_seq, arrived_seq, events, blocks)


def map_of(source: str, transfer_id: TransferId, c: Compacted, n: Unpacked) -> Map:
    """The side's map as far as decisions and findings read it."""
    return Map(
        seq=n.map_seq, ts=n.map_ts, source=source, transfer_id=transfer_id, request_id=c.request_id,
        role=c.role, mode=c.mode, block_ids=n.block_ids, deadline=n.deadline, acks_expected=n.acks_expected,
    )  # fmt: skip


def release_of(source: str, transfer_id: TransferId, c: Compacted, n: Unpacked) -> Release:
    return Release(
        source, transfer_id, c.request_id, c.role, c.mode, n.block_ids, c.cause, n.decision_seq, n.decision_ts,
        c.reason, c.why,
    )  # fmt: skip
