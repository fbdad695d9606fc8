"""The fold: everything that affects a transfer's lifecycle lives in this file.

Sans-IO like h11's `_state.py`: no clock, no threads, no I/O, no randomness,
no logging. `LedgerState.apply(event)` updates the state in place in O(1)
(O(blocks or layers named by the event)) and returns the `Release` the event
caused, if any. Folding the same events in the same order always gives the
same state and the same releases. The fold does not know which role it
plays: each transfer side is keyed by `(source, transfer_id)`, and its role
comes from its `map` event.

Lifecycle (the table `TRANSITIONS` below; guards take decisions):

    unmapped --map--> held --schedule--> active --seal--> sealed
       |               |                   |                |
       +--expire-->  expired   (guards: completing ack -> completed,
                                terminal fail -> failed, expire -> expired)

An event that does not fit the table (an ack before its map, a duplicate, an
event after the decision) is recorded as evidence for an audit finding and
never raises.
"""

from __future__ import annotations

import heapq
import struct
from collections import deque
from collections.abc import Callable, Iterable
from typing import Final, Literal, TypeAlias

import msgspec

from ledger.decisions import Cause, Key, Release
from ledger.events import (
    Ack,
    Drop,
    Event,
    Expire,
    Fail,
    Map,
    Mode,
    ReqId,
    Role,
    Schedule,
    Seal,
    TransferId,
    local_exceeds_remote,
)
from ledger.idmemory import IdMemory
from ledger.limits import (
    DEADLINE_HEAP_SLACK,
    EVIDENCE_SEQS_MAX,
    FORGED_KEPT_MAX,
    LAYER_MASKS_CACHED_MAX,
    LAYERS_MAX,
    ORPHAN_TOMBSTONES_MAX,
    RANKS_MAX,
    TOMBSTONES_MAX,
)
from ledger.tombstone import Compacted, compacted, map_of, release_of, unpack

PhaseName: TypeAlias = Literal["unmapped", "held", "active", "sealed", "completed", "failed", "expired"]


class Phase:
    """Phase names. Plain strings, not an Enum: Enum hashing runs Python code, and the
    table lookup below is on the hot path of every event."""

    UNMAPPED: Final[PhaseName] = "unmapped"
    HELD: Final[PhaseName] = "held"
    ACTIVE: Final[PhaseName] = "active"
    SEALED: Final[PhaseName] = "sealed"
    COMPLETED: Final[PhaseName] = "completed"
    FAILED: Final[PhaseName] = "failed"
    EXPIRED: Final[PhaseName] = "expired"
    ALL: Final[tuple[PhaseName, ...]] = (
        "unmapped", "held", "active", "sealed", "completed", "failed", "expired",
    )  # fmt: skip


TERMINAL: frozenset[PhaseName] = frozenset({Phase.COMPLETED, Phase.FAILED, Phase.EXPIRED})

_U, _H, _A, _S = Phase.UNMAPPED, Phase.HELD, Phase.ACTIVE, Phase.SEALED

TRANSITIONS: dict[tuple[PhaseName, str], PhaseName] = {
    (_U, "map"): _H,
    (_U, "schedule"): _U,
    (_U, "seal"): _U,
    (_U, "ack"): _U,
    (_U, "fail"): _U,
    (_U, "expire"): Phase.EXPIRED,
    (_H, "map"): _H,
    (_H, "schedule"): _A,
    (_H, "seal"): _S,
    (_H, "ack"): _H,
    (_H, "fail"): _H,
    (_H, "expire"): Phase.EXPIRED,
    (_A, "map"): _A,
    (_A, "schedule"): _A,
    (_A, "seal"): _S,
    (_A, "ack"): _A,
    (_A, "fail"): _A,
    (_A, "expire"): Phase.EXPIRED,
    (_S, "map"): _S,
    (_S, "schedule"): _S,
    (_S, "seal"): _S,
    (_S, "ack"): _S,
    (_S, "fail"): _S,
    (_S, "expire"): Phase.EXPIRED,
}
"""(phase, event kind) -> phase before guards. Terminal phases absorb every event
(recorded as late). Guards may then move a live phase to completed or failed."""

NEXT_PHASE: dict[str, dict[PhaseName, PhaseName]] = {}
for (_phase, _kind), _next in TRANSITIONS.items():
    NEXT_PHASE.setdefault(_kind, {})[_phase] = _next
"""TRANSITIONS by kind, then phase: the same table, looked up without building a tuple per event."""
_AFTER_SCHEDULE: Final = NEXT_PHASE["schedule"]
_AFTER_SEAL: Final = NEXT_PHASE["seal"]

ACKS_A_SIDE_RECEIVES: frozenset[tuple[Role, Mode, str]] = frozenset({
    ("producer", "read", "release"),
    ("producer", "write", "write"),
    ("producer", "write", "release"),
    ("producer", "read", "lease"),
    ("producer", "write", "lease"),
    ("consumer", "read", "read"),
    ("consumer", "read", "recv"),
    ("consumer", "write", "recv"),
    ("consumer", "write", "write"),
})  # fmt: skip
"""(role, mode, ack kind) that fit: producers see writes and releases, consumers reads and recv."""

CAUSE_PHASE: dict[Cause, PhaseName] = {
    "completed": Phase.COMPLETED,
    "failed": Phase.FAILED,
    "expired": Phase.EXPIRED,
}

REASON_LEASE_MISSED = "lease_missed"
"""An expire of a side whose deadline a lease renewal had moved: its consumer stopped renewing."""

REASON_READ_REFUSED = "read_refused"
"""A read the producer refused (its side was no longer held) or one a consumer could not confirm: a load
error, never a success. Counted by the fold (`lease_counts["reads_refused"]`)."""

REASON_LOCAL_EXCEEDS_REMOTE = "local_blocks_exceed_remote"
"""A consumer holding more blocks than the producer sent cannot be filled."""


class TransferState(msgspec.Struct, gc=False):
    """One side of one transfer, as derived from its events.

    A msgspec Struct without GC tracking: it holds only ids, numbers, tuples and
    sets of ints, never a cycle, and the collector would otherwise rescan every
    live transfer on every young-generation pass.
    """

    # Field order is memory order: what most events read or write comes first, so one event
    # touches two cache lines of its side rather than five. `_first_map` builds it positionally.
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
    """The first event seen for this side (its map, in the common case)."""
    pending_fail_seq: int = 0
    """A terminal fail seen before the map: applied when the map arrives."""
    fail_reason: str = ""
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
        return self.first.seq if self.first is not None else 0

    @property
    def first_ts(self) -> float:
        return self.first.ts if self.first is not None else 0.0

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


def layers_mask(layers: tuple[int, ...]) -> int:
    """The bitmask of `layers`; -1 when one is outside [0, LAYERS_MAX) (the event is then
    evidence of a bad appender and changes no count)."""
    mask = 0
    for layer in layers:
        if not 0 <= layer < LAYERS_MAX:
            return -1
        mask |= 1 << layer
    return mask


"""A compacted mapped side (a never-mapped side that expired is kept whole in `orphan_tombstones`)."""


def _note(seqs: list[int] | None, seq: int) -> list[int]:
    if seqs is None:
        return [seq]
    if len(seqs) < EVIDENCE_SEQS_MAX:
        seqs.append(seq)
    return seqs


class LedgerState:
    """All transfer sides of one log (or of several merged), plus the audit indexes."""

    def __init__(self) -> None:
        self.transfers: dict[Key, TransferState] = {}
        self.live: dict[Key, TransferState] = {}
        """Mapped, undecided: the sides holding blocks."""
        self.unmapped: dict[Key, TransferState] = {}
        """Events seen, no map yet; ordered by first sight for the orphan audit."""
        self.deadlines: list[tuple[float, int, str, str]] = []
        """Heap of (deadline, map seq, source, transfer id) of live transfers; stale
        entries (already decided) are skipped and swept when they dominate."""
        self.held: dict[str, set[int]] = {}
        """Per source: the block ids live transfer sides hold (a set: claims and frees run at C speed)."""
        self.contested: dict[tuple[str, int], list[Key]] = {}
        """(source, block) -> every live side claiming a block held twice, first claimant first."""
        self.double_owned: dict[Key, list[tuple[int, Key, int]]] = {}
        """Transfer side -> (block, other owner, map seq) claims that collided."""
        self.anomalous: dict[Key, None] = {}
        """Transfer sides with late, duplicate, over-ack or id-reuse evidence."""
        self.orphans_expired: dict[Key, None] = {}
        """Never-mapped sides whose early events were expired."""
        self.expired_producers: dict[Key, None] = {}
        """Producer sides released by expire: candidates for premature_release."""
        self.retrying: dict[Key, TransferState] = {}
        """Undecided sides with a transient failure: what a worker re-issues, without scanning every live side."""
        self.sources: dict[str, None] = {}
        self.tombstones: dict[Key, Compacted] = {}
        """Compacted sides, newest generation. When it holds `tombstones_max / 2` it becomes
        `tombstones_old` and the older one is evicted: bounded, no per-key pop."""
        self.tombstones_old: dict[Key, Compacted] = {}
        self.tombstones_max = TOMBSTONES_MAX
        self.tombstones_evicted = 0
        """Tombstones evicted by the bound: from the first one on, answers about those sides are
        approximate (the id memory) and a replay says so."""
        self.orphan_tombstones: dict[Key, TransferState] = {}
        """Never-mapped sides that expired, compacted whole (their early events decide a late map:
        released at once, or failed by an early fail), newest generation; bounded apart from the
        mapped sides' tombstones, so the common eviction never reaches them. Exact: a map's decision
        must never rest on a filter's false positive (it would release a fresh transfer at once)."""
        self.orphan_tombstones_old: dict[Key, TransferState] = {}
        self.orphan_tombstones_max = ORPHAN_TOMBSTONES_MAX
        self.orphans_evicted = 0
        """Compacted orphans evicted by their bound: a map for one is then taken for a fresh transfer
        (held until released or expired: safe), and a replay says so."""
        self.id_memory: IdMemory | None = None
        """Keys of mapped sides ever compacted (created at the first compaction), consulted only
        once a tombstone was evicted, so that below the bound every answer is exact."""
        self.decided: deque[tuple[float, Key, TransferState]] = deque()
        """(decision ts, key, side) in decision order: what `forget_decided` pops from, O(1) per side.
        Holds only sides still in `transfers` (`compact` filters it)."""
        self.late_after_eviction = 0
        """Events other than maps for sides whose tombstone was evicted (counted, not judged)."""
        self.reused_after_eviction = 0
        """Maps refused because the id memory remembers their id after its tombstone was evicted."""
        self.compacted_by_phase: dict[str, int] = {}
        self.compacted_by_mode: dict[str, int] = {}
        self.releases_by_cause: dict[Cause, int] = {"completed": 0, "failed": 0, "expired": 0}
        self.forged_by_reason: dict[str, int] = {}
        """Control messages refused as unproven (`drop` events), by reason: what the service counts."""
        self.lease_counts: dict[str, int] = {}
        """`renewals`: lease renewals folded (`ack` what=lease); `expiries`: sides expired after a renewal
        had moved their deadline (the consumer stopped renewing); `reads_refused`: reads refused because
        the side they named was no longer held (`fail` with REASON_READ_REFUSED). What the service counts."""
        self.forged_recent: deque[Drop] = deque(maxlen=FORGED_KEPT_MAX)
        """The latest `drop` events, the audit's evidence (a snapshot keeps the counts, not these)."""
        self.blocks_held = 0
        self.layer_masks: dict[tuple[int, ...], int] = {}
        """A cache of `layers_mask` (not state: a refold rebuilds it)."""
        self._handlers: dict[type, Callable[[TransferState, Event], Release | None]] = {
            Map: self._on_map,  # type: ignore[dict-item]
            Schedule: self._on_schedule,  # type: ignore[dict-item]
            Seal: self._on_seal,  # type: ignore[dict-item]
            Ack: self._on_ack,  # type: ignore[dict-item]
            Fail: self._on_fail,  # type: ignore[dict-item]
            Expire: self._on_expire,  # type: ignore[dict-item]
        }

    # -- the entry point -------------------------------------------------

    def apply(self, event: Event) -> Release | None:
        """Fold one event; return the release it caused, if any."""
        kind = type(event)
        if kind is Drop:
            self._on_drop(event)  # type: ignore[arg-type]  # about a peer, not a transfer side
            return None
        key = (event.source, event.transfer_id)
        t = self.transfers.get(key)
        if t is None:
            if (
                (self.tombstones or self.tombstones_old) and (key in self.tombstones or key in self.tombstones_old)
            ) or (
                (self.orphan_tombstones or self.orphan_tombstones_old)
                and (key in self.orphan_tombstones or key in self.orphan_tombstones_old)
            ):
                t = self._recall(key, event.ts)
            elif self.tombstones_evicted and self._remembered(key):
                self._after_eviction(event)
                return None
            elif kind is Map:
                return self._first_map(key, event)  # type: ignore[arg-type]
            else:
                t = self._first_sight(event)
        t.last = event
        t.events += 1
        if t.closed:
            if t.role is not None and kind is Map:
                return self._on_map(t, event)  # type: ignore[arg-type]  # a reused id or a duplicate, never late
            if not (t.role is None and kind is Expire):
                t.late_seqs = _note(t.late_seqs, event.seq)
                self.anomalous[key] = None
            if t.role is None and kind is Map:
                return self._on_map(t, event)  # type: ignore[arg-type]  # given up before its map: map, release
            return None
        # The commonest events (WRITE mode's layer schedules and acks, three in five) are folded
        # here when they decide nothing and need no evidence; the handlers take every other case.
        if kind is Ack:
            layers = event.layers  # type: ignore[union-attr]
            if layers is not None and event.what == "write" and t.role == "producer" and t.mode == "write":  # type: ignore[union-attr]
                mask = self.layer_masks.get(layers)
                if mask is not None:
                    acked = t.acked_mask
                    if not acked & mask and t.scheduled_mask & mask == mask:
                        acked |= mask
                        if t.expected is None or acked.bit_count() < t.expected:
                            t.acked_mask = acked
                            return None
            return self._on_ack(t, event)  # type: ignore[arg-type]
        if kind is Schedule:
            layers = event.layers  # type: ignore[union-attr]
            if layers is not None and t.role is not None and not (t.early_mask or event.deferred or event.attempt):  # type: ignore[union-attr]
                mask = self.layer_masks.get(layers)
                if mask is not None and mask >= 0 and not t.scheduled_mask & mask:
                    t.scheduled_mask |= mask
                    t.phase = _AFTER_SCHEDULE[t.phase]
                    return None
            return self._on_schedule(t, event)  # type: ignore[arg-type]
        return self._handlers[kind](t, event)

    def _on_drop(self, e: Drop) -> None:
        self.forged_by_reason[e.reason] = self.forged_by_reason.get(e.reason, 0) + 1
        self.forged_recent.append(e)

    def _first_sight(self, event: Event) -> TransferState:
        key: Key = (event.source, event.transfer_id)
        if event.source not in self.sources:
            self.sources[event.source] = None
        t = TransferState(
            last=event, source=event.source, transfer_id=event.transfer_id, first=event,
        )  # fmt: skip
        self.transfers[key] = t
        self.unmapped[key] = t
        return t

    def _first_map(self, key: Key, e: Map) -> Release | None:
        """The common case, a map before any other event of its side, in one step."""
        if e.source not in self.sources:
            self.sources[e.source] = None
        seq = e.seq
        # Positional on purpose (msgspec parses keywords ~8x slower, and this runs once per side),
        # in field order: last, events, closed, role, phase, mode, the five masks and counts,
        # acks_expected, recv, whole_acked, whole_scheduled, decision, source, transfer_id, map, first.
        t = TransferState(
            e, 1, False, e.role, Phase.HELD, e.mode, 0, 0, None, 0, 0, e.acks_expected, False, False, False,
            None, e.source, e.transfer_id, e, e,
        )  # fmt: skip
        self.transfers[key] = t
        self.live[key] = t
        held = self.held.get(e.source)
        if held is not None and held.isdisjoint(e.block_ids):
            before = len(held)
            held.update(e.block_ids)  # the common case inline; _claim_blocks handles the rest
            self.blocks_held += len(e.block_ids)
            if len(held) - before != len(e.block_ids):
                self._duplicate(t, seq)  # a block named twice in its own map
        else:
            self._claim_blocks(t, key)
        heapq.heappush(self.deadlines, (e.deadline, seq, e.source, e.transfer_id))
        if len(self.deadlines) > DEADLINE_HEAP_SLACK * (len(self.live) + 16):
            self._sweep_deadlines()
        if local_exceeds_remote(e):
            return self._decide(t, "failed", e.seq, e.ts, REASON_LOCAL_EXCEEDS_REMOTE)
        return None

    # -- handlers: one per kind -------------------------------------------

    def _on_map(self, t: TransferState, e: Map) -> Release | None:
        key: Key = (e.source, e.transfer_id)
        if t.role is not None:
            # Refused, whatever the side's phase: a transfer id is single-use per side.
            if t.request_id == e.request_id:
                t.duplicate_seqs = _note(t.duplicate_seqs, e.seq)
            else:
                t.reuse_seqs = _note(t.reuse_seqs, e.seq)
                if t.reused_by is None:
                    t.reused_by = [e.request_id]
                elif len(t.reused_by) < EVIDENCE_SEQS_MAX:
                    t.reused_by.append(e.request_id)
            self.anomalous[key] = None
            return None
        expired_unmapped = t.closed
        if expired_unmapped:
            # Reopened: drop its orphan-expiry entry (O(decided), only on this fault path); the
            # decision below adds the one `forget_decided` will honour.
            self.decided = deque(item for item in self.decided if item[2] is not t)
        t.closed = False
        self.unmapped.pop(key, None)
        t.role = e.role
        t.mode = e.mode
        t.map_event = e
        t.acks_expected = e.acks_expected
        t.phase = TRANSITIONS[(Phase.UNMAPPED, "map")]
        if t.expected is not None:
            t.phase = Phase.SEALED
        elif t.scheduled_mask or t.whole_scheduled:
            t.phase = Phase.ACTIVE
        self.live[key] = t
        self._claim_blocks(t, key)
        if t.lease_until is not None and (e.role != "producer" or t.lease_until <= e.deadline):
            t.lease_until = None  # a renewal before the map counts only where it moves a producer's deadline
        heapq.heappush(self.deadlines, (t.deadline or e.deadline, e.seq, e.source, e.transfer_id))
        if len(self.deadlines) > DEADLINE_HEAP_SLACK * (len(self.live) + 16):
            self._sweep_deadlines()
        if local_exceeds_remote(e):
            return self._decide(t, "failed", e.seq, e.ts, REASON_LOCAL_EXCEEDS_REMOTE)
        if t.pending_fail_seq:
            return self._decide(t, "failed", e.seq, e.ts, t.fail_reason)
        if expired_unmapped:
            return self._decide(t, "expired", e.seq, e.ts, "expired before its map arrived")
        if t.early_mask & t.scheduled_mask:
            self._adopt_early_acks(t)
        return self._check_complete(t, e.seq, e.ts)

    def _on_schedule(self, t: TransferState, e: Schedule) -> Release | None:
        first_try = not (e.deferred or e.attempt)  # only a repeat of a first, undeferred issue is a duplicate
        if not first_try:
            if e.deferred:
                t.deferrals += 1
            if e.attempt > 0:
                t.retries += 1
        layers = e.layers
        if layers is None:
            if t.whole_scheduled and first_try:
                self._duplicate(t, e.seq)
            t.whole_scheduled = True
        else:
            mask = self.layer_masks.get(layers)
            if mask is None:
                mask = self._mask_of(layers)
            if mask < 0:
                self._over_ack(t, e.seq)  # a layer number no model has: evidence, not state
                return None
            scheduled = t.scheduled_mask
            if scheduled & mask and first_try:
                self._duplicate(t, e.seq)
            t.scheduled_mask = scheduled | mask
            if t.early_mask:
                self._adopt_early_acks(t)
                if t.role is not None:
                    t.phase = _AFTER_SCHEDULE[t.phase]
                    return self._check_complete(t, e.seq, e.ts)  # adopted acks may complete it
        if t.role is not None:
            t.phase = _AFTER_SCHEDULE[t.phase]
        return None

    def _on_seal(self, t: TransferState, e: Seal) -> Release | None:
        if t.expected is not None and t.expected != e.expected:
            self._duplicate(t, e.seq)
        t.expected = e.expected
        if t.acked_mask.bit_count() > e.expected:
            self._over_ack(t, e.seq)
        if t.role is None:
            return None
        t.phase = _AFTER_SEAL[t.phase]
        return self._check_complete(t, e.seq, e.ts)

    def _on_ack(self, t: TransferState, e: Ack) -> Release | None:
        what = e.what
        if what == "lease":
            self._on_lease(t, e)
            return None
        layers = e.layers
        if what == "write" and layers is not None and t.role == "producer" and t.mode == "write":
            # The hot path (write acks of a mapped WRITE producer): same rules, fewer steps. A READ
            # producer does not receive write acks: over-ack evidence, never its completion.
            mask = self.layer_masks.get(layers)
            if mask is None:
                mask = self._mask_of(layers)
            acked = t.acked_mask
            if mask >= 0 and not acked & mask and t.scheduled_mask & mask == mask:
                acked |= mask
                t.acked_mask = acked
                expected = t.expected
                if expected is not None:
                    count = acked.bit_count()
                    if count >= expected:
                        if count > expected:
                            self._over_ack(t, e.seq)
                        return self._decide(t, "completed", e.seq, e.ts, "")
                return None
        if what == "release":
            rank = e.rank
            if not 0 <= rank < RANKS_MAX:
                self._over_ack(t, e.seq)  # no such rank: evidence, not state
                return None
            bit = 1 << rank
            if t.ranks_mask & bit:
                self._duplicate(t, e.seq)
            t.ranks_mask |= bit
        elif what == "recv":
            if t.recv:
                self._duplicate(t, e.seq)
            t.recv = True
            if t.arrived_ts is None:
                t.arrived_ts, t.arrived_seq = e.ts, e.seq
        elif e.layers is None:
            if t.whole_acked:
                self._duplicate(t, e.seq)
            t.whole_acked = True
            if what == "read" and t.arrived_ts is None:
                t.arrived_ts, t.arrived_seq = e.ts, e.seq
        else:
            self._ack_layers(t, e)
        if t.role is None:
            return None
        if (t.role, t.mode, what) not in ACKS_A_SIDE_RECEIVES:
            self._over_ack(t, e.seq)
        return self._check_complete(t, e.seq, e.ts)

    def _on_lease(self, t: TransferState, e: Ack) -> None:
        """A lease renewal moves the side's deadline to `until` when that is later (never earlier): the
        deadline heap gets the new entry, and `due` skips the old one."""
        until = e.until
        assert until is not None  # Ack validates it
        counts = self.lease_counts
        counts["renewals"] = counts.get("renewals", 0) + 1
        t.leases += 1
        if t.role is None:
            if t.lease_until is None or until > t.lease_until:
                t.lease_until = until  # weighed against the map's deadline when it arrives
            return
        if t.role != "producer":
            self._over_ack(t, e.seq)  # only a producer holds blocks for a peer
            return
        current = t.deadline
        if current is not None and until <= current:
            return
        t.lease_until = until
        heapq.heappush(self.deadlines, (until, t.map_seq, t.source, t.transfer_id))
        if len(self.deadlines) > DEADLINE_HEAP_SLACK * (len(self.live) + 16):
            self._sweep_deadlines()

    def _on_fail(self, t: TransferState, e: Fail) -> Release | None:
        if e.reason.startswith(REASON_READ_REFUSED):
            self.lease_counts["reads_refused"] = self.lease_counts.get("reads_refused", 0) + 1
        if e.retryable:
            t.transient_failures += 1
            if t.transient_since is None:
                t.transient_since = e.ts
            self.retrying[(t.source, t.transfer_id)] = t
            return None
        if t.role is None:
            if not t.pending_fail_seq:
                t.pending_fail_seq = e.seq
                t.fail_reason = e.reason
            return None
        return self._decide(t, "failed", e.seq, e.ts, e.reason)

    def _on_expire(self, t: TransferState, e: Expire) -> Release | None:
        if t.role is None:
            key: Key = (e.source, e.transfer_id)
            t.phase = Phase.EXPIRED
            t.closed = True
            del self.unmapped[key]
            self.decided.append((e.ts, key, t))
            self.orphans_expired[key] = None
            if self.retrying:
                self.retrying.pop(key, None)
            return None
        if t.lease_until is not None:
            self.lease_counts["expiries"] = self.lease_counts.get("expiries", 0) + 1
            return self._decide(t, "expired", e.seq, e.ts, f"{REASON_LEASE_MISSED} ({t.leases} renewals)")
        return self._decide(t, "expired", e.seq, e.ts, f"{e.deadline} deadline passed")

    # -- guards and bookkeeping ------------------------------------------

    def _ack_layers(self, t: TransferState, e: Ack) -> None:
        layers = e.layers
        assert layers is not None
        mask = self.layer_masks.get(layers)
        if mask is None:
            mask = self._mask_of(layers)
        if mask < 0:
            self._over_ack(t, e.seq)  # a layer number no model has: evidence, not state
            return
        acked, scheduled = t.acked_mask, t.scheduled_mask
        if acked & mask:
            self._duplicate(t, e.seq)
        fresh = mask & ~acked
        acked |= fresh & scheduled
        t.acked_mask = acked
        early = fresh & ~scheduled
        if early:
            if t.early_mask & early:
                self._duplicate(t, e.seq)
            t.early_mask |= early
            if t.role is not None:
                self._over_ack(t, e.seq)
        if t.expected is not None and acked.bit_count() > t.expected:
            self._over_ack(t, e.seq)

    def _mask_of(self, layers: tuple[int, ...]) -> int:
        """`layers_mask(layers)`, remembered: a model's steps name the same few layer tuples."""
        masks = self.layer_masks
        if len(masks) >= LAYER_MASKS_CACHED_MAX:
            masks.clear()
        mask = masks[layers] = layers_mask(layers)
        return mask

    def _adopt_early_acks(self, t: TransferState) -> None:
        landed = t.early_mask & t.scheduled_mask
        if landed:
            t.acked_mask |= landed
            t.early_mask &= ~landed

    def _check_complete(self, t: TransferState, seq: int, ts: float) -> Release | None:
        if t.role == "producer":
            if t.mode == "read":
                done = t.ranks_mask.bit_count() >= t.acks_expected
            else:
                done = (t.expected is not None and t.acked_mask.bit_count() >= t.expected) or (
                    t.ranks_mask.bit_count() >= t.acks_expected
                )
        elif t.mode == "write":
            done = t.recv
        else:
            done = t.recv or t.whole_acked or (t.expected is not None and t.acked_mask.bit_count() >= t.expected)
        if done:
            return self._decide(t, "completed", seq, ts, "")
        return None

    def _decide(self, t: TransferState, cause: Cause, seq: int, ts: float, reason: str) -> Release:
        assert t.decision is None, f"second decision for {t.key}"
        m = t.map_event
        assert m is not None and t.role is not None and t.mode is not None
        # Positional: see _first_map.
        release = Release(t.source, t.transfer_id, m.request_id, t.role, t.mode, m.block_ids, cause, seq, ts, reason)
        t.decision = release
        t.closed = True
        if cause == "completed" and t.role == "consumer" and t.arrived_ts is None:
            t.arrived_ts, t.arrived_seq = ts, seq
        t.phase = CAUSE_PHASE[cause]
        key = (t.source, t.transfer_id)
        del self.live[key]
        if self.contested:
            self._free_blocks(t, key)
        else:  # the common case inline: no block has two claimants
            self.blocks_held -= len(m.block_ids)
            self.held[t.source].difference_update(m.block_ids)
        self.releases_by_cause[cause] += 1
        self.decided.append((ts, key, t))
        if self.retrying:
            self.retrying.pop(key, None)
        if cause == "expired" and t.role == "producer":
            self.expired_producers[key] = None
        return release

    def _claim_blocks(self, t: TransferState, key: Key) -> None:
        held = self.held.get(t.source)
        if held is None:
            held = self.held[t.source] = set()
        blocks = t.block_ids
        self.blocks_held += len(blocks)
        if held.isdisjoint(blocks):
            before = len(held)
            held.update(blocks)  # the common case, at C speed
            if len(held) - before != len(blocks):
                self._duplicate(t, t.map_seq)  # a block named twice in its own map
            return
        # A side claims each block once, however often its map names it: the claims index must
        # let go of it exactly once too (a repeated id is evidence, never a second claim).
        distinct = dict.fromkeys(blocks)
        if len(distinct) != len(blocks):
            self._duplicate(t, t.map_seq)
        for block in distinct:
            if block not in held:
                held.add(block)
                continue
            claimants = self.contested.get((t.source, block))
            if claimants is None:
                # Rare: find who holds it (a scan of this source's live sides), then record both.
                owner = next(
                    (k for k, o in self.live.items() if o is not t and o.source == t.source and block in o.block_ids),
                    None,
                )
                if owner is None:
                    continue  # no other live side holds it (cannot happen while the index is right)
                claimants = self.contested[(t.source, block)] = [owner]
            elif key in claimants:
                continue
            self.double_owned.setdefault(key, []).append((block, claimants[0], t.map_seq))
            claimants.append(key)

    def _free_blocks(self, t: TransferState, key: Key) -> None:
        held = self.held[t.source]
        contested = self.contested
        self.blocks_held -= len(t.block_ids)
        if not contested:
            held.difference_update(t.block_ids)  # no block has two claimants: all of these are its own
            return
        for block in dict.fromkeys(t.block_ids):  # each block once: it was claimed once
            claimants = contested.get((t.source, block))
            if claimants is None:
                held.discard(block)
                continue
            if key not in claimants:
                continue  # held by the others named there, not by this side
            claimants.remove(key)
            if len(claimants) == 1:
                del contested[(t.source, block)]  # the other claimant keeps holding it

    def claimants(self, source: str, block: int) -> list[Key]:
        """The live sides holding `block` on `source` (for tests and the service; not the hot path)."""
        contested = self.contested.get((source, block))
        if contested is not None:
            return list(contested)
        if block not in self.held.get(source, ()):
            return []
        return [k for k, t in self.live.items() if t.source == source and block in t.block_ids]

    def _duplicate(self, t: TransferState, seq: int) -> None:
        t.duplicate_seqs = _note(t.duplicate_seqs, seq)
        self.anomalous[t.key] = None

    def _over_ack(self, t: TransferState, seq: int) -> None:
        t.over_ack_seqs = _note(t.over_ack_seqs, seq)
        self.anomalous[t.key] = None

    def _sweep_deadlines(self) -> None:
        live = self.live
        self.deadlines = [
            d
            for d in self.deadlines
            if (t := live.get((d[2], d[3]))) is not None and t.deadline == d[0]  # type: ignore[arg-type]
        ]
        heapq.heapify(self.deadlines)

    # -- queries used by the shells --------------------------------------

    def due(self, now: float) -> list[TransferState]:
        """Live sides whose deadline is at or before `now`, earliest first.

        Walks only the heap nodes at or before `now` (and their children), so the
        cost follows the number due, not the number live. Does not mutate.
        """
        heap, live = self.deadlines, self.live
        found: list[tuple[float, int, TransferState]] = []
        stack = [0] if heap else []
        while stack:
            i = stack.pop()
            deadline, seq, source, tid = heap[i]
            if deadline > now:
                continue
            t = live.get((source, tid))  # type: ignore[arg-type]
            if t is not None and t.map_seq == seq and (t.lease_until is None or t.lease_until == deadline):
                found.append((deadline, seq, t))
            for child in (2 * i + 1, 2 * i + 2):
                if child < len(heap):
                    stack.append(child)
        found.sort(key=lambda item: (item[0], item[1]))
        return [t for _, _, t in found]

    def orphans_due(self, now: float, timeout_s: float) -> list[TransferState]:
        """Never-mapped sides first seen more than `timeout_s` before `now`."""
        out = []
        for t in self.unmapped.values():
            if t.first_ts + timeout_s > now:
                break
            out.append(t)
        return out

    # -- memory upkeep -----------------------------------------------------
    #
    # The compaction rule: a side may be compacted only when no later event can change a decision
    # or a finding about it, unless what the side becomes still answers that event the same way.
    # A live or never-mapped, unexpired side is never compacted (later events decide it). A decided
    # mapped side becomes a `Compacted` tombstone (ledger/tombstone.py): a later event recalls it
    # whole enough to judge (late, duplicate or reused id, with the same evidence and detail), and a
    # merged audit reads its decision and arrival (premature_release) from it. A side with evidence
    # (see `has_evidence`) stays whole when the caller keeps evidence (replay, the service). Only
    # evicting a tombstone past `tombstones_max` loses anything: the events that then find no
    # tombstone are counted (`late_after_eviction`, `reused_after_eviction`), never silently judged.

    def compact(
        self,
        upto_seq_by_source: dict[str, int] | None = None,
        *,
        clean_only: bool = False,
        decided_before_ts: float | None = None,
    ) -> int:
        """Compact decided sides, so memory follows live transfers rather than log length.

        With `upto_seq_by_source`, only sides whose last event is at or below that seq
        (persisted) go. With `clean_only`, sides that carry audit evidence (see
        `has_evidence`) stay whole. With `decided_before_ts`, only sides whose last event is
        older than that go. Each becomes a tombstone (bounded by `tombstones_max`); phase and
        mode counts of compacted sides are kept in `compacted_by_phase` / `compacted_by_mode`.
        Returns how many went.
        """
        dropped = 0
        for key, t in list(self.transfers.items()):
            if not t.closed:
                continue
            if upto_seq_by_source is not None and t.last_seq > upto_seq_by_source.get(t.source, -1):
                continue
            if decided_before_ts is not None and t.last_ts >= decided_before_ts:
                continue
            if clean_only and self.has_evidence(key):
                continue
            dropped += self._forget(key, t)
        if dropped:
            transfers = self.transfers
            self.decided = deque(item for item in self.decided if item[1] in transfers)
        return dropped

    def forget_decided(self, before_ts: float, *, keep_evidence: bool = False) -> int:
        """Compact sides decided before `before_ts` whose last event is older too, in decision order;
        O(1) per side (what a running connector does every step, and a replay between chunks).
        With `keep_evidence`, sides an audit would report (see `has_evidence`) stay whole for good
        instead. Returns how many went."""
        decided = self.decided
        dropped = 0
        while decided and decided[0][0] < before_ts:
            _, key, t = decided.popleft()
            if not t.closed:
                continue  # an orphan expired, then mapped after all: its decision will come again
            last = t.last
            if last is not None and last.ts >= before_ts:
                decided.append((last.ts, key, t))  # a late event came: keep it visible a little longer
                continue
            if keep_evidence and self.has_evidence(key):
                continue
            dropped += self._forget(key, t)
        return dropped

    def has_evidence(self, key: Key) -> bool:
        """Whether an audit reports the side, or may: late, duplicate, over-ack or reuse events, a
        double-owned block, an expired orphan, a producer released by expire, or a consumer of a
        transfer whose producer was (the pair a premature_release is made of). Kept whole, such a
        side can never be lost to the tombstone bound."""
        if key in self.anomalous or key in self.double_owned or key in self.orphans_expired:
            return True
        expired = self.expired_producers
        if not expired:
            return False
        if key in expired:
            return True
        tid = key[1]
        return any((source, tid) in expired for source in self.sources)

    def _forget(self, key: Key, t: TransferState) -> bool:
        """Compact one decided side; False (kept whole) when its numbers do not fit a tombstone."""
        m, decision = t.map_event, t.decision
        tomb: Compacted | None = None
        if m is not None and decision is not None:
            try:
                tomb = compacted(m, decision, t.arrived_ts, t.arrived_seq, t.events)
            except (OverflowError, struct.error):
                return False  # integers past 64 bits (no valid event has them): kept whole, as evidence
        del self.transfers[key]
        # The evidence indexes are usually empty: skip hashing the key into them.
        if self.anomalous:
            self.anomalous.pop(key, None)
        if self.double_owned:
            self.double_owned.pop(key, None)
        if self.orphans_expired:
            self.orphans_expired.pop(key, None)
        if tomb is not None:
            memory = self.id_memory
            if memory is None:
                memory = self.id_memory = IdMemory()
            memory.add(key[0], key[1])
            tombstones = self.tombstones
            tombstones[key] = tomb
            if len(tombstones) >= self.tombstones_max // 2:
                self._evict(self.tombstones_old)
                self.tombstones_old, self.tombstones = tombstones, {}
        else:
            orphans = self.orphan_tombstones
            orphans[key] = t
            if len(orphans) >= self.orphan_tombstones_max // 2:
                self.orphans_evicted += len(self.orphan_tombstones_old)
                self.orphan_tombstones_old, self.orphan_tombstones = orphans, {}
        phase = t.phase
        by_phase, by_mode = self.compacted_by_phase, self.compacted_by_mode
        by_phase[phase] = by_phase.get(phase, 0) + 1
        mode = t.mode or "unmapped"
        by_mode[mode] = by_mode.get(mode, 0) + 1
        return True

    def _evict(self, generation: dict[Key, Compacted]) -> None:
        """The bound: the oldest tombstones go; from now on their keys are only in the id memory."""
        if not generation:
            return
        self.tombstones_evicted += len(generation)
        if self.expired_producers:
            expired = self.expired_producers
            for key in generation:
                expired.pop(key, None)

    def _tombstone(self, key: Key) -> Compacted | None:
        tomb = self.tombstones.get(key)
        return tomb if tomb is not None else self.tombstones_old.get(key)

    def _recall(self, key: Key, ts: float) -> TransferState:
        """Bring a compacted side back into `transfers` because an event for it came."""
        tomb = self.tombstones.pop(key, None)
        if tomb is None:
            tomb = self.tombstones_old.pop(key, None)
        if tomb is not None:
            t = _rebuilt(key, tomb)
        else:
            orphan = self.orphan_tombstones.pop(key, None)
            t = orphan if orphan is not None else self.orphan_tombstones_old.pop(key)
            self.orphans_expired[key] = None
        self.transfers[key] = t
        self.compacted_by_phase[t.phase] -= 1  # counted whole again (summaries add both)
        self.compacted_by_mode[t.mode or "unmapped"] -= 1
        self.decided.append((ts, key, t))
        return t

    def _remembered(self, key: Key) -> bool:
        memory = self.id_memory
        return memory is not None and memory.contains(key[0], key[1])

    def _after_eviction(self, event: Event) -> None:
        """An event for a side compacted and then evicted: a map is refused, anything else is late;
        both are counted (a replay reports them), neither can be judged in full any more."""
        if type(event) is Map:
            self.reused_after_eviction += 1
        else:
            self.late_after_eviction += 1

    # -- queries ------------------------------------------------------------

    def was_mapped(self, key: Key) -> bool:
        """Whether a map of `key` would be refused: the side was mapped, live, decided or compacted (and,
        past the tombstone bound, the id memory says so; see ledger/idmemory.py for its error rates)."""
        t = self.transfers.get(key)
        if t is not None:
            return t.role is not None
        if self._tombstone(key) is not None:
            return True
        return bool(self.tombstones_evicted) and self._remembered(key)

    def side(self, key: Key) -> TransferState | None:
        """The side of `key` as an audit sees it: held whole, or rebuilt (detached) from its tombstone."""
        t = self.transfers.get(key)
        if t is not None:
            return t
        tomb = self._tombstone(key)
        if tomb is not None:
            return _rebuilt(key, tomb)
        orphan = self.orphan_tombstones.get(key)
        return orphan if orphan is not None else self.orphan_tombstones_old.get(key)

    @property
    def tombstone_count(self) -> int:
        """Compacted sides held: mapped sides' tombstones and never-mapped sides kept whole."""
        return (
            len(self.tombstones)
            + len(self.tombstones_old)
            + len(self.orphan_tombstones)
            + len(self.orphan_tombstones_old)
        )


def _rebuilt(key: Key, tomb: Compacted) -> TransferState:
    """A decided side from its tombstone: what audits and later events read is as it was."""
    numbers = unpack(tomb)
    m = map_of(key[0], key[1], tomb, numbers)
    return TransferState(
        last=m,
        events=numbers.events,
        closed=True,
        role=tomb.role,
        phase=CAUSE_PHASE[tomb.cause],
        mode=tomb.mode,
        acks_expected=numbers.acks_expected,
        decision=release_of(key[0], key[1], tomb, numbers),
        source=key[0],
        transfer_id=key[1],
        map_event=m,
        first=m,
        arrived_ts=numbers.arrived_ts,
        arrived_seq=numbers.arrived_seq,
    )


def fold(state: LedgerState, event: Event) -> LedgerState:
    """`state` after `event` (updated in place and returned, eventsourcing-style)."""
    state.apply(event)
    return state


def fold_all(events: Iterable[Event], state: LedgerState | None = None) -> tuple[LedgerState, list[Release]]:
    """Fold a whole stream; return the state and every release in decision order."""
    state = LedgerState() if state is None else state
    releases: list[Release] = []
    apply = state.apply
    for event in events:
        release = apply(event)
        if release is not None:
            releases.append(release)
    return state, releases
