"""One side of one transfer as its events made it: `TransferState`, its plain fields and their views.

A module of its own so that ledger/side.py, compiled, can read a side as a C struct (ledger/structs.pxd
declares this class's layout; a compiled module cannot declare a class it defines itself). The rules that
read a side are in ledger/side.py."""

from __future__ import annotations

from typing import Final

import msgspec

from kvledger.ledger.decisions import Key, Release
from kvledger.ledger.events import Event, Fail, Map, Mode, ReqId, Role, TransferId
from kvledger.ledger.lifecycle import Phase, PhaseName


class TransferState(msgspec.Struct, gc=False, array_like=True):
    """One side of one transfer, as derived from its events.

    A msgspec Struct without GC tracking: it holds only ids, numbers, tuples and
    sets of ints, never a cycle, and the collector would otherwise rescan every
    live transfer on every young-generation pass. Array-like: only a snapshot
    (ledger/store/snapshot.py) encodes a side, and as an array of its fields it
    decodes straight into sides, with no field names to write and match and no
    conversion side by side (that was a quarter of a service's start).
    """

    # Field order is the constructor's: `LedgerState._first_map` builds a side positionally, so what a
    # map sets comes first. In memory msgspec sorts the fields by name (ledger/structs.pxd declares that
    # layout for the compiled fold).
    last: Event | None = None
    """This side's newest event (one reference, not its seq and ts copied: a store per event less)."""
    events: int = 0
    closed: bool = False
    """A decision was taken, or a never-mapped side expired: later events are late."""
    role: Role | None = None
    phase: PhaseName = Phase.UNMAPPED
    mode: Mode | None = None
    scheduled_mask: int = 0
    """Bit i set: layer i was scheduled. Layers and ranks are small ints, and an int is
    not tracked by the garbage collector the way a set per side is."""
    acked_mask: int = 0
    expected: int | None = None
    early_mask: int = 0
    """Layer acks that arrived before their schedule: counted once it comes."""
    ranks_mask: int = 0
    """Bit r set: consumer rank r sent its release ack."""
    acks_expected: int = 1
    recv: bool = False
    whole_acked: bool = False
    whole_scheduled: bool = False
    decision: Release | None = None
    source: str = ""
    transfer_id: TransferId = TransferId("")
    map_event: Map | None = None
    """The side's map: its request id, blocks, peer and deadline are read from it (one reference
    instead of eight copies, fewer objects to let go of when the side is forgotten)."""
    first: Event | None = None
    """The first event seen for this side when that was not its map; None: its map was (nearly always).
    Read through `first_seq` and `first_ts`. Not a second reference to the map: a snapshot writes each
    reference it meets, and would write and decode every map twice (or copy every side to leave it out)."""
    pending_fail: Fail | None = None
    """A terminal fail seen before the map: applied when the map arrives."""
    transient_failures: int = 0
    transient_since: float | None = None
    """The ts of the first transient failure: a retry window counts from here, not from the map."""
    retries: int = 0
    deferrals: int = 0
    arrived_ts: float | None = None
    """When all KV had arrived (consumer side): the read that premature_release compares."""
    arrived_seq: int = 0
    late_seqs: list[int] | None = None
    duplicate_seqs: list[int] | None = None
    over_ack_seqs: list[int] | None = None
    reuse_seqs: list[int] | None = None
    reused_by: list[ReqId] | None = None
    """The requests whose maps of this side's id were refused (id_reuse), in order."""
    lease_until: float | None = None
    """The deadline the consumer's latest lease renewal moved this side to (None: its map's deadline
    holds). Per side: forgotten with it."""
    leases: int = 0
    """Lease renewals folded on this side."""

    @property
    def key(self) -> Key:
        return (self.source, self.transfer_id)

    @property
    def request_id(self) -> ReqId | None:
        return self.map_event.request_id if self.map_event is not None else None

    @property
    def block_ids(self) -> tuple[int, ...]:
        return self.map_event.block_ids if self.map_event is not None else ()

    @property
    def remote_block_ids(self) -> tuple[int, ...] | None:
        return self.map_event.remote_block_ids if self.map_event is not None else None

    @property
    def peer(self) -> str | None:
        return self.map_event.peer if self.map_event is not None else None

    @property
    def deadline(self) -> float | None:
        """The map's deadline, or the later one a lease renewal moved it to."""
        if self.lease_until is not None:
            return self.lease_until
        return self.map_event.deadline if self.map_event is not None else None

    @property
    def map_seq(self) -> int:
        return self.map_event.seq if self.map_event is not None else 0

    @property
    def first_seq(self) -> int:
        first = self.first if self.first is not None else self.map_event
        return first.seq if first is not None else 0

    @property
    def first_ts(self) -> float:
        first = self.first if self.first is not None else self.map_event
        return first.ts if first is not None else 0.0

    @property
    def last_seq(self) -> int:
        """The seq of this side's newest event."""
        return self.last.seq if self.last is not None else 0

    @property
    def last_ts(self) -> float:
        """The ts of this side's newest event."""
        return self.last.ts if self.last is not None else 0.0

    @property
    def mapped(self) -> bool:
        return self.role is not None

    @property
    def live(self) -> bool:
        """Holding blocks with no decision yet."""
        return self.role is not None and self.decision is None

    @property
    def has_anomaly(self) -> bool:
        return bool(self.late_seqs or self.duplicate_seqs or self.over_ack_seqs or self.reuse_seqs)

    @property
    def scheduled(self) -> set[int]:
        """Layers scheduled so far."""
        return bits(self.scheduled_mask)

    @property
    def acked(self) -> set[int]:
        """Scheduled layers acked so far."""
        return bits(self.acked_mask)

    @property
    def early_acks(self) -> set[int]:
        """Layers acked before their schedule, not counted yet."""
        return bits(self.early_mask)

    @property
    def release_ranks(self) -> set[int]:
        """Consumer ranks whose release ack arrived."""
        return bits(self.ranks_mask)

    def snapshot(self) -> dict[str, object]:
        """A plain-data view (masks as sorted lists) for equality checks and the API."""
        out: dict[str, object] = {}
        for name in self.__struct_fields__:
            value = getattr(self, name)
            if name in _EVENT_VIEWS:
                for derived in _EVENT_VIEWS[name]:
                    out[derived] = getattr(self, derived)
                continue
            if name in _MASK_VIEWS:
                name = _MASK_VIEWS[name]
                value = sorted(bits(value))
            elif isinstance(value, Release):
                value = {f: getattr(value, f) for f in value.__struct_fields__}
            out[name] = value
        return out


_EVENT_VIEWS: Final[dict[str, tuple[str, ...]]] = {
    "last": ("last_seq", "last_ts"),
    "first": ("first_seq", "first_ts"),
    "map_event": ("request_id", "block_ids", "remote_block_ids", "peer", "deadline", "map_seq"),
}
"""Event references and the plain fields read from them that snapshots and the API show."""

_MASK_VIEWS: Final[dict[str, str]] = {
    "scheduled_mask": "scheduled",
    "acked_mask": "acked",
    "early_mask": "early_acks",
    "ranks_mask": "release_ranks",
}
"""Bitmask fields and the names their sorted lists go by in snapshots and the API."""


def bits(mask: int) -> set[int]:
    """The positions of the set bits of `mask` (layer or rank numbers)."""
    out: set[int] = set()
    while mask:
        low = mask & -mask
        out.add(low.bit_length() - 1)
        mask ^= low
    return out
