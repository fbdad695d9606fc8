"""The fold: how each event changes one transfer side, and when a side is released.

Sans-IO like h11's `_state.py`: no clock, no threads, no I/O, no randomness,
no logging. `LedgerState.apply(event)` updates the state in place in O(1)
(O(blocks or layers named by the event)) and returns the `Release` the event
caused, if any. Folding the same events in the same order always gives the
same state and the same releases. The fold does not know which role it
plays: each transfer side is keyed by `(source, transfer_id)`, and its role
comes from its `map` event.

Where the rest lives: a side and the one completion rule (`side.py`), the phases and the
table of every phase change (`lifecycle.py`), the indexes the audits read (`indexes.py`),
and memory upkeep, compaction and tombstones (`upkeep.py`). Every phase change below is a
lookup in the lifecycle table; an event the table has no row for (anything after a terminal
phase) takes one named path, `_after_close`, which records it as evidence and never raises.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Final

from kvledger.ledger.compiled import declared_fields
from kvledger.ledger.decisions import Cause, Key, Release, Why
from kvledger.ledger.events import Ack, Drop, Event, Expire, Fail, Map, Schedule, Seal
from kvledger.ledger.lifecycle import ACKS_A_SIDE_RECEIVES, DECIDED, NEXT_PHASE, Phase
from kvledger.ledger.limits import FORGED_KEPT_MAX, LAYER_MASKS_CACHED_MAX, RANKS_MAX
from kvledger.ledger.side import (
    TransferState,
    completed_by,
    count64,
    layers_mask,
    local_exceeds_remote,
    low_layers_mask,
)
from kvledger.ledger.upkeep import Upkeep

try:
    import cython
except ImportError:  # no Cython here: this module runs as Python
    COMPILED = False
else:
    COMPILED = cython.compiled

_AFTER_MAP: Final = NEXT_PHASE["map"]
_MAPPED: Final = _AFTER_MAP[Phase.UNMAPPED]
"""The phase a side's first event, its map, leaves it in (looked up once: compiled, `Phase.UNMAPPED` is an
attribute lookup on the enum class)."""
_AFTER_SCHEDULE: Final = NEXT_PHASE["schedule"]
_AFTER_SEAL: Final = NEXT_PHASE["seal"]
_AFTER_EXPIRE: Final = NEXT_PHASE["expire"]

REASON_LEASE_MISSED = "lease_missed"
"""An expire of a side whose deadline a lease renewal had moved: its consumer stopped renewing."""

REASON_LOCAL_EXCEEDS_REMOTE = "local_blocks_exceed_remote"
"""A consumer holding more blocks than the producer sent cannot be filled."""

REASON_EXPIRED_BEFORE_MAP = "expired before its map arrived"


class Fold(Upkeep):
    """The fold's rules and counts over the indexes and upkeep (what `LedgerState` is made of)."""

    def __init__(self) -> None:
        super().__init__()
        self.releases_by_cause: dict[Cause, int] = {"completed": 0, "failed": 0, "expired": 0}
        self.forged_by_reason: dict[str, int] = {}
        """Control messages refused as unproven (`drop` events), by reason: what the service counts."""
        self.lease_counts: dict[str, int] = {}
        """`renewals`: lease renewals folded (`ack` what=lease); `expiries`: sides expired after a renewal
        had moved their deadline (the consumer stopped renewing); `reads_refused`: reads refused because
        the side they named was no longer held (`fail` with code `read_refused`). What the service counts."""
        self.forged_recent: deque[Drop] = deque(maxlen=FORGED_KEPT_MAX)
        """The latest `drop` events, the audit's evidence (a snapshot keeps the counts, not these)."""
        self.layer_masks: dict[tuple[int, ...], int] = {}
        """A cache of `layers_mask` (not state: a refold rebuilds it)."""

    # -- the entry point -------------------------------------------------

    def apply(self, event: Event) -> Release | None:
        """Fold one event; return the release it caused, if any."""
        kind = type(event)
        if kind is Drop:
            self._on_drop(event)  # type: ignore[arg-type]  # about a peer, not a transfer side
            return None
        # Compiled, `envelope` and the typed names below (ledger/fold.pxd) read an event's fields as C
        # struct members (ledger/structs.pxd) where `event.x` would be an attribute lookup; interpreted,
        # they are the same object under another name.
        envelope = event
        by_id = self.sides_of.get(envelope.source)
        t = None if by_id is None else by_id.get(envelope.transfer_id)
        if t is None:
            key = (envelope.source, envelope.transfer_id)
            if (
                (self.tombstones or self.tombstones_old) and (key in self.tombstones or key in self.tombstones_old)
            ) or (
                (self.orphan_tombstones or self.orphan_tombstones_old)
                and (key in self.orphan_tombstones or key in self.orphan_tombstones_old)
            ):
                t = self._recall(key, envelope.ts)
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
            return self._after_close(t, event)
        # The commonest events (WRITE mode's layer schedules and acks, three in five) are folded
        # here when they decide nothing and need no evidence: the handlers' rules for that case,
        # inlined, and every other case goes to the handler. The layer mask: compiled, a C loop over
        # the layers (no tuple hashed); interpreted, the cache's (a lookup in C, where the loop would
        # be Python). Either way 0 (none yet, or none that fits) takes the handler's general path.
        # Compiled, the masks here are 64-bit C integers (ledger/fold.pxd): a side's mask past 64 bits (a
        # model of more layers) does not convert, and takes the handler's path too. Interpreted, they are
        # Python ints of any width (the cache's masks name layers past 63 too).
        if kind is Ack:
            ack: Ack = event  # type: ignore[assignment]
            layers = ack.layers
            if layers is not None and ack.what == "write" and t.role == "producer" and t.mode == "write":
                mask = low_layers_mask(layers) if COMPILED else self.layer_masks.get(layers, 0)
                if mask > 0:
                    try:
                        acked = t.acked_mask
                        scheduled = t.scheduled_mask
                    except OverflowError:
                        return self._on_ack(t, ack)
                    if not acked & mask and scheduled & mask == mask:
                        acked |= mask
                        if t.expected is None or (count64(acked) if COMPILED else acked.bit_count()) < t.expected:
                            t.acked_mask = acked
                            return None
            return self._on_ack(t, ack)
        if kind is Schedule:
            schedule: Schedule = event  # type: ignore[assignment]
            layers = schedule.layers
            first_try = not (schedule.deferred or schedule.attempt)
            if layers is not None and t.role is not None and first_try and not t.early_mask:
                mask = low_layers_mask(layers) if COMPILED else self.layer_masks.get(layers, 0)
                if mask > 0:
                    try:
                        scheduled = t.scheduled_mask
                    except OverflowError:
                        return self._on_schedule(t, schedule)
                    if not scheduled & mask:
                        t.scheduled_mask = scheduled | mask
                        t.phase = _AFTER_SCHEDULE[t.phase]
                        return None
            return self._on_schedule(t, schedule)
        # The rest, a quarter of all events: a chain of identity tests costs less than a dict lookup.
        if kind is Map:
            return self._on_map(t, event)  # type: ignore[arg-type]
        if kind is Seal:
            return self._on_seal(t, event)  # type: ignore[arg-type]
        if kind is Fail:
            return self._on_fail(t, event)  # type: ignore[arg-type]
        return self._on_expire(t, event)  # type: ignore[arg-type]

    def _after_close(self, t: TransferState, event: Event) -> Release | None:
        """An event for a side in a terminal phase: the lifecycle table has no row for it, so it is
        recorded as evidence. Two maps are their own evidence: a map of a mapped side is a refused
        reuse or a duplicate (`_on_map`); the map of a side given up before its map is late, and
        reopens it (mapped, then released at once by `_on_map`)."""
        if type(event) is Map:
            if t.role is None:
                self._late(t, event.seq)
            return self._on_map(t, event)
        if not (t.role is None and type(event) is Expire):  # an orphan expired twice: nothing new
            self._late(t, event.seq)
        return None

    def _on_drop(self, e: Drop) -> None:
        self.forged_by_reason[e.reason] = self.forged_by_reason.get(e.reason, 0) + 1
        self.forged_recent.append(e)

    def _first_sight(self, event: Event) -> TransferState:
        key: Key = (event.source, event.transfer_id)
        if event.source not in self.sources:
            self.sources[event.source] = None
        if self.orphans_evicted:
            self.sides_unchecked += 1  # it may name an evicted orphan (ledger/upkeep.py)
        t = TransferState(
            last=event, source=event.source, transfer_id=event.transfer_id, first=event,
        )  # fmt: skip
        self._put_side(key, t)
        self.unmapped[key] = t
        return t

    def _first_map(self, key: Key, e: Map) -> Release | None:
        """The common case, a map before any other event of its side: the side is made mapped."""
        if e.source not in self.sources:
            self.sources[e.source] = None
        if self.orphans_evicted:
            self.sides_unchecked += 1  # it may name an evicted orphan (ledger/upkeep.py)
        # Positional on purpose (msgspec parses keywords ~8x slower, and this runs once per side),
        # in field order: last, events, closed, role, phase, mode, the five masks and counts,
        # acks_expected, recv, whole_acked, whole_scheduled, decision, source, transfer_id, map, then `first`
        # None (the map was the side's first event).
        t = TransferState(
            e, 1, False, e.role, _MAPPED, e.mode, 0, 0, None, 0, 0, e.acks_expected,
            False, False, False, None, e.source, e.transfer_id, e, None,
        )  # fmt: skip
        self._put_side(key, t)
        return self._hold(t, key, e, e.deadline)

    def _hold(self, t: TransferState, key: Key, e: Map, deadline: float) -> Release | None:
        """A mapped side holds its blocks until its decision: live, its block claims, its deadline."""
        self.live[key] = t
        # A third of all events are maps: the common claim (no block held by another side) is
        # `_claim_blocks`'s first lines, inlined; the deadline is pushed by `_push_deadline` (a C call
        # compiled, and the one place a heap entry is made).
        # Loops, not `isdisjoint` and `update`: compiled, they are C calls on the set (a method call
        # allocates an iterator, and the collector counts it).
        blocks = e.block_ids
        held = self.held.get(e.source)
        if held is None:
            self._claim_blocks(t, key)  # the source's first map
        else:
            # One pass: each block added, and the set's size tells whether it was there already. If one was
            # (held by another side, or named twice in this map), the blocks added before it are taken out
            # again, leaving `held` as it was, and the general path claims them all.
            for i in range(len(blocks)):
                before = len(held)
                held.add(blocks[i])
                if len(held) == before:
                    for j in range(i):
                        held.discard(blocks[j])
                    self._claim_blocks(t, key)
                    break
            else:
                self.blocks_held += len(blocks)
        self._push_deadline(deadline, e.seq, t)
        if local_exceeds_remote(e):
            return self._decide(t, "failed", e.seq, e.ts, REASON_LOCAL_EXCEEDS_REMOTE, "local_exceeds_remote")
        return None

    # -- handlers: one per kind -------------------------------------------

    def _on_map(self, t: TransferState, e: Map) -> Release | None:
        key: Key = (e.source, e.transfer_id)
        if t.role is not None:
            self._refused_map(t, e.seq, e.request_id)
            return None
        expired_unmapped = t.closed
        phase = t.phase
        if expired_unmapped:
            # Reopened: the orphan's expiry is undone and decided again below (as expired). Its entry in
            # `decided` goes (O(decided), only on this fault path); the decision adds the one to honour.
            self.decided = deque([item for item in self.decided if item[3] is not t])  # a list: compiled, no closure
            t.closed = False
            phase = Phase.UNMAPPED
        self.unmapped.pop(key, None)
        t.role = e.role
        t.mode = e.mode
        t.map_event = e
        t.acks_expected = e.acks_expected
        # The map, then the schedules and seal the side gathered unmapped, in the table's order.
        phase = _AFTER_MAP[phase]
        if t.scheduled_mask or t.whole_scheduled:
            phase = _AFTER_SCHEDULE[phase]
        if t.expected is not None:
            phase = _AFTER_SEAL[phase]
        t.phase = phase
        if t.lease_until is not None and (e.role != "producer" or t.lease_until <= e.deadline):
            t.lease_until = None  # a renewal before the map counts only where it moves a producer's deadline
        release = self._hold(t, key, e, t.deadline or e.deadline)
        if release is not None:
            return release
        pending = t.pending_fail
        if pending is not None:
            return self._decide(t, "failed", e.seq, e.ts, pending.reason, pending.code)
        if expired_unmapped:
            return self._decide(t, "expired", e.seq, e.ts, REASON_EXPIRED_BEFORE_MAP, "expired_before_map")
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
            self._over_ack(t, e.seq)  # e.g. a write ack for a READ producer: evidence, never its completion
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
        self._push_deadline(until, t.map_seq, t)

    def _on_fail(self, t: TransferState, e: Fail) -> Release | None:
        if e.code == "read_refused":
            self.lease_counts["reads_refused"] = self.lease_counts.get("reads_refused", 0) + 1
        if e.retryable:
            t.transient_failures += 1
            if t.transient_since is None:
                t.transient_since = e.ts
            self.retrying[(t.source, t.transfer_id)] = t
            return None
        if t.role is None:
            if t.pending_fail is None:
                t.pending_fail = e  # the first terminal fail decides the map when it comes
            return None
        return self._decide(t, "failed", e.seq, e.ts, e.reason, e.code)

    def _on_expire(self, t: TransferState, e: Expire) -> Release | None:
        if t.role is None:
            # Given up before its map: no blocks to release, closed; a late map reopens it.
            key: Key = (e.source, e.transfer_id)
            t.phase = _AFTER_EXPIRE[t.phase]
            t.closed = True
            del self.unmapped[key]
            self.decided.append((e.ts, e.source, e.transfer_id, t))
            self.orphans_expired[key] = None
            self._found("orphan_ack")
            if self.retrying:
                self.retrying.pop(key, None)
            return None
        if t.lease_until is not None:
            self.lease_counts["expiries"] = self.lease_counts.get("expiries", 0) + 1
            reason = f"{REASON_LEASE_MISSED} ({t.leases} renewals)"
            return self._decide(t, "expired", e.seq, e.ts, reason, "lease_missed")
        return self._decide(t, "expired", e.seq, e.ts, f"{e.deadline} deadline passed", "deadline")

    # -- layers ------------------------------------------------------------

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

    # -- decisions ---------------------------------------------------------

    def _check_complete(self, t: TransferState, seq: int, ts: float) -> Release | None:
        if completed_by(t) is not None:
            return self._decide(t, "completed", seq, ts, "", "completed")
        return None

    def _decide(self, t: TransferState, cause: Cause, seq: int, ts: float, reason: str, why: Why) -> Release:
        assert t.decision is None, f"second decision for {t.key}"
        m = t.map_event
        assert m is not None and t.role is not None and t.mode is not None
        # Positional: see _first_map.
        release = Release(
            t.source, t.transfer_id, m.request_id, t.role, t.mode, m.block_ids, cause, seq, ts, reason, why
        )
        t.decision = release
        t.closed = True
        if cause == "completed" and t.role == "consumer" and t.arrived_ts is None:
            t.arrived_ts, t.arrived_seq = ts, seq
        t.phase = DECIDED[cause][t.phase]
        key = (t.source, t.transfer_id)
        del self.live[key]
        if self.contested:
            self._free_blocks(t, key)
        else:  # the common case inline: no block has two claimants
            blocks = m.block_ids
            self.blocks_held -= len(blocks)
            held = self.held[t.source]
            for block in blocks:
                held.discard(block)
        self.releases_by_cause[cause] += 1
        self.decided.append((ts, t.source, t.transfer_id, t))
        if self.retrying:
            self.retrying.pop(key, None)
        if cause == "expired" and t.role == "producer":
            self.expired_producers[key] = None
        return release


class LedgerState(Fold):
    """All transfer sides of one log (or of several merged), their indexes, and the fold's counts.

    Where the fold is compiled, `Fold` is an extension type: its methods cannot be replaced and its
    fields live in the object, not in an instance dict. This plain subclass is what callers make, so
    that it patches and subclasses as before, and `vars()` lists the fields either way (the snapshot
    checks them)."""

    if COMPILED:

        @property
        def __dict__(self) -> dict[str, object]:  # type: ignore[override]
            return {name: getattr(self, name) for name in declared_fields(type(self))}


def fold(state: LedgerState, event: Event) -> LedgerState:
    """`state` after `event` (updated in place and returned, eventsourcing-style)."""
    state.apply(event)
    return state


def apply_all(state: Fold, events: Iterable[Event], out: list[Release]) -> None:
    """Fold `events` in order into `state` (a list, or a stream folded as it comes), appending each release
    they cause to `out`. Compiled (fold.pxd), one C loop that calls `apply` as a C method (a list walked by
    index): a batch's events each cost a Python call otherwise (the bound method looked up, its arguments
    parsed), a twentieth of an append's work."""
    for event in events:
        release = state.apply(event)
        if release is not None:
            out.append(release)


def fold_all(events: Iterable[Event], state: LedgerState | None = None) -> tuple[LedgerState, list[Release]]:
    """Fold a whole stream; return the state and every release in decision order."""
    state = LedgerState() if state is None else state
    releases: list[Release] = []
    apply_all(state, events, releases)
    return state, releases
