"""Memory upkeep: decided sides compacted into tombstones, forgotten in decision order, recalled when
a later event names them, and the bound past which tombstones are evicted (then only the id memory
remembers their ids). The rule that keeps this from changing any answer is written below, at
`Upkeep`; the property tests hold it (tests/ledger/test_compaction_properties.py)."""

from __future__ import annotations

import struct
from collections import deque

from kvledger.ledger.decisions import Key
from kvledger.ledger.events import Event, Map
from kvledger.ledger.idmemory import IdMemory
from kvledger.ledger.indexes import Indexes
from kvledger.ledger.lifecycle import CAUSE_PHASE
from kvledger.ledger.limits import ORPHAN_TOMBSTONES_MAX, TOMBSTONES_MAX
from kvledger.ledger.side import TransferState
from kvledger.ledger.tombstone import (
    Compacted,
    compacted,
    found_bits,
    map_of,
    mark_found,
    release_of,
    unpack,
    with_found,
)


class Upkeep(Indexes):
    """The indexes, plus what bounds their memory.

    The compaction rule: a side may be compacted only when no later event can change a decision
    or a finding about it, unless what the side becomes still answers that event the same way.
    A live or never-mapped, unexpired side is never compacted (later events decide it). A decided
    mapped side becomes a `Compacted` tombstone (ledger/tombstone.py): a later event recalls it
    whole enough to judge (late, duplicate or reused id, with the same evidence and detail), and a
    merged audit reads its decision and arrival (premature_release) from it. A side with evidence
    (see `has_evidence`) stays whole when the caller keeps evidence (replay, the service). Only
    evicting a tombstone past `tombstones_max` loses anything: the events that then find no
    tombstone are counted (`late_after_eviction`, `reused_after_eviction`), never silently judged.
    """

    def __init__(self) -> None:
        super().__init__()
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
        (held until released or expired: safe, but not what the whole history decides: released at once,
        as expired before its map), and a replay says so."""
        self.sides_unchecked = 0
        """Sides first seen (by their map or any other event) after an orphan was evicted: each may be an
        evicted orphan's, which the fold can no longer tell (no id of an evicted orphan is kept), so its
        decision and findings may differ from the whole history's (`kvledger.ledger.summary.compaction_warning`)."""
        self.id_memory: IdMemory | None = None
        """Keys of mapped sides ever compacted (created at the first compaction), consulted only
        once a tombstone was evicted, so that below the bound every answer is exact."""
        self.late_after_eviction = 0
        """Events other than maps for sides whose tombstone was evicted (counted, not judged)."""
        self.reused_after_eviction = 0
        """Maps refused because the id memory remembers their id after its tombstone was evicted."""
        self.compacted_by_phase: dict[str, int] = {}
        self.compacted_by_mode: dict[str, int] = {}

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
            self.decided = deque(item for item in self.decided if (item[1], item[2]) in transfers)
        return dropped

    def forget_decided(self, before_ts: float, *, keep_evidence: bool = False) -> int:
        """Compact sides decided before `before_ts` whose last event is older too, in decision order;
        O(1) per side (what a running connector does every step, and a replay between chunks).
        With `keep_evidence`, sides an audit would report (see `has_evidence`) stay whole for good
        instead. Returns how many went."""
        decided = self.decided
        dropped = 0
        while decided and decided[0][0] < before_ts:
            _, source, transfer_id, t = decided.popleft()
            if not t.closed:
                continue  # an orphan expired, then mapped after all: its decision will come again
            last = t.last
            if last is not None and last.ts >= before_ts:
                decided.append((last.ts, source, transfer_id, t))  # a late event came: keep it visible a little longer
                continue
            key = (source, transfer_id)
            if keep_evidence and self.has_evidence(key):
                continue
            dropped += self._forget(key, t)
        return dropped

    def _forget(self, key: Key, t: TransferState) -> bool:
        """Compact one decided side; False (kept whole) when its numbers do not fit a tombstone."""
        m, decision = t.map_event, t.decision
        tomb: Compacted | None = None
        if m is not None and decision is not None:
            try:
                tomb = compacted(m, decision, t.arrived_ts, t.arrived_seq, t.events)
            except (OverflowError, struct.error):
                return False  # integers past 64 bits (no valid event has them): kept whole, as evidence
            if (
                t.late_seqs is not None
                or t.duplicate_seqs is not None
                or t.over_ack_seqs is not None
                or t.reuse_seqs is not None
            ):
                tomb = with_found(tomb, found_bits(t))  # its findings stay found (`found_by_code`)
        self._drop_side(key)
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
        self._put_side(key, t)
        self.compacted_by_phase[t.phase] -= 1  # counted whole again (summaries add both)
        self.compacted_by_mode[t.mode or "unmapped"] -= 1
        self.decided.append((ts, key[0], key[1], t))
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
    t = TransferState(
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
        arrived_ts=numbers.arrived_ts,
        arrived_seq=numbers.arrived_seq,
    )
    if tomb.found:
        mark_found(t, tomb.found)
    return t
