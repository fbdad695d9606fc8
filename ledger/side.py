"""The one reading of a transfer side's evidence: whether it is complete (`completed_by`, `is_complete`)
and whether a transient failure left data still to move (`awaits_data`), with the bitmask rules the fold
counts layers and ranks by. Sans-IO, like the fold that reads them. The side itself, `TransferState`, is
in ledger/transfer_state.py (imported here too, where callers have always found it)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal, TypeAlias

from kvledger.ledger.decisions import Key
from kvledger.ledger.events import Map
from kvledger.ledger.limits import LAYERS_MAX
from kvledger.ledger.transfer_state import TransferState, bits

__all__ = [
    "Evidence", "TransferState", "awaits_data", "bits", "completed_by", "copies", "count64", "due_at", "is_complete",
    "layers_mask", "local_exceeds_remote", "low_layers_mask", "requests_of", "wide_masks",
]  # fmt: skip


def local_exceeds_remote(m: Map) -> bool:
    """A consumer holds more blocks than its producer filled (in some KV cache group): no pairing exists."""
    remote = m.remote_block_ids
    if m.role != "consumer" or remote is None:
        return False
    if m.block_groups is None or m.remote_block_groups is None:
        return len(m.block_ids) > len(remote)
    if len(m.block_groups) != len(m.remote_block_groups):
        return True
    for local, far in zip(m.block_groups, m.remote_block_groups, strict=True):  # noqa: SIM110 (compiled: no closure)
        if local > far:
            return True
    return False


def layers_mask(layers: tuple[int, ...]) -> int:
    """The bitmask of `layers`; -1 when one is outside [0, LAYERS_MAX) (the event is then
    evidence of a bad appender and changes no count)."""
    mask = 0
    for layer in layers:
        if not 0 <= layer < LAYERS_MAX:
            return -1
        mask |= 1 << layer
    return mask


_ONE = 1
"""Compiled, a 64-bit unsigned C constant (ledger/side.pxd): the shift below is then 64 bits wide."""


def low_layers_mask(layers: tuple[int, ...]) -> int:
    """The bitmask of `layers` when there is one at least and each is in [0, 64), else 0. The fold's fast
    paths take it instead of a lookup of the tuple in its mask cache (hashing and comparing the tuple cost
    more than this loop, compiled on a 64-bit C integer); on 0 they take the general path."""
    mask = 0
    try:
        for item in layers:
            layer = item  # compiled: a C long read off the int (one past 64 bits raises OverflowError)
            if not 0 <= layer < 64:
                return 0
            mask |= _ONE << layer
    except OverflowError:
        return 0
    return mask


_M1 = 0x5555555555555555
_M2 = 0x3333333333333333
_M4 = 0x0F0F0F0F0F0F0F0F
_H01 = 0x0101010101010101
_MASK64 = 0xFFFFFFFFFFFFFFFF
"""`count64`'s constants: names, not literals, so that compiled they are 64-bit C constants (ledger/side.pxd)."""


def count64(mask: int) -> int:
    """The set bits of `mask`, a mask below 2**64 (as `int.bit_count`): compiled, C arithmetic on a 64-bit
    integer, where `bit_count` is a method call on an int object (the fold's fast path counts acked layers
    so). Interpreted, the same arithmetic, masked to 64 bits."""
    x = mask - ((mask >> 1) & _M1)
    x = (x & _M2) + ((x >> 2) & _M2)
    x = (x + (x >> 4)) & _M4
    return ((x * _H01) & _MASK64) >> 56


Evidence: TypeAlias = Literal["release_acks", "all_written", "recv", "whole_read", "all_read"]
"""What completed a side: its consumers' release acks, every sealed write acked, the consumer's recv,
one whole read, or every sealed layer read."""


def completed_by(t: TransferState) -> Evidence | None:
    """The evidence that completes this side, or None while it is incomplete. The one home of the
    completion rule: the fold decides on it, the worker and the timeline read it."""
    if t.role == "producer":
        if t.mode == "write" and t.expected is not None and t.acked_mask.bit_count() >= t.expected:
            return "all_written"
        return "release_acks" if t.ranks_mask.bit_count() >= t.acks_expected else None
    if t.recv:
        return "recv"
    if t.mode == "write":
        return None  # a WRITE consumer completes on recv alone: the producer writes, it does not read
    if t.whole_acked:
        return "whole_read"
    if t.expected is not None and t.acked_mask.bit_count() >= t.expected:
        return "all_read"
    return None


def due_at(t: TransferState) -> float | None:
    """When a live side is due: its `deadline` while it is `live`, None once it holds nothing (never mapped,
    or decided). The properties' rule, read as C fields where compiled (the properties are Python calls):
    the deadline heap asks it of every entry it sweeps or finds due."""
    if t.role is None or t.decision is not None:
        return None
    if t.lease_until is not None:
        return t.lease_until
    m = t.map_event
    assert m is not None  # mapped: `role` comes with the map
    return m.deadline


def is_complete(t: TransferState) -> bool:
    """Whether the side's evidence completes it (see `completed_by`)."""
    return completed_by(t) is not None


def awaits_data(t: TransferState) -> bool:
    """Whether the data this side moves is still missing: a READ consumer without its whole read, a
    WRITE producer with sealed layers unwritten (what a worker re-issues after a transient failure).
    False for sides that move no data themselves (READ producers, WRITE consumers)."""
    if t.role == "consumer" and t.mode == "read":
        return not t.whole_acked
    if t.role == "producer" and t.mode == "write":
        return t.expected is not None and t.acked_mask.bit_count() < t.expected
    return False


def copies(sides: Iterable[TransferState]) -> list[TransferState]:
    """Copies of `sides` that share nothing the fold changes later, so that a snapshot can encode them while
    the fold goes on (ledger/store/snapshot.py). The fold replaces a side's fields, never changes them in
    place, but for its lists of seqs and request ids, which grow: those are copied too (nearly always None).
    Compiled, a side's fields are read as C struct fields: a third of the time of the same loop in Python."""
    out: list[TransferState] = []
    for side in sides:
        t = side.__copy__()  # type: ignore[attr-defined]  # msgspec's own copy, in C
        if t.late_seqs is not None:
            t.late_seqs = list(t.late_seqs)
        if t.duplicate_seqs is not None:
            t.duplicate_seqs = list(t.duplicate_seqs)
        if t.over_ack_seqs is not None:
            t.over_ack_seqs = list(t.over_ack_seqs)
        if t.reuse_seqs is not None:
            t.reuse_seqs = list(t.reuse_seqs)
        if t.reused_by is not None:
            t.reused_by = list(t.reused_by)
        out.append(t)
    return out


def wide_masks(sides: list[TransferState], bits_max: int) -> list[int]:
    """The indexes of the sides with a layer or rank mask of more than `bits_max` bits."""
    return [
        i
        for i, t in enumerate(sides)
        if (t.scheduled_mask | t.acked_mask | t.early_mask | t.ranks_mask).bit_length() > bits_max
    ]


def requests_of(keys: list[Key], sides: list[TransferState]) -> dict[str, tuple[Key, ...]]:
    """Each request id's sides (`keys[i]` is `sides[i]`'s key) by the maps they hold, in the sides' order:
    the service's request index as the sides alone give it (api/snapshots.py writes only where its own
    differs). The keys are the caller's own tuples, not built again: a third of this pass's time, and a
    tuple more per side kept for the service's life. Compiled, a side and its map are read as C structs."""
    if len(keys) != len(sides):
        raise ValueError(f"{len(keys)} keys for {len(sides)} sides")
    out: dict[str, tuple[Key, ...]] = {}
    for i in range(len(sides)):
        t = sides[i]
        m = t.map_event
        if m is not None:
            request_id = m.request_id
            keys_of = out.get(request_id)
            out[request_id] = (keys[i],) if keys_of is None else (*keys_of, keys[i])
    return out
