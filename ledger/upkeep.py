"""Memory upkeep: decided sides compacted into tombstones, forgotten in decision order, recalled when
a later event names them, and retired by time (then only the exact id memory remembers a mapped
side's id). The rules that keep this from changing any answer are written below, at `Upkeep`; the
property tests hold them (tests/ledger/test_compaction_properties.py, test_exact_memory.py)."""

from __future__ import annotations

import struct
from collections import deque

from ledger.decisions import Key
from ledger.events import Event, Map
from ledger.idmemory import IdMemory
from ledger.indexes import Indexes
from ledger.lifecycle import CAUSE_PHASE
from ledger.limits import ARRIVAL_LAG_S, SIDE_HORIZON_S
from ledger.side import TransferState
from ledger.tombstone import Compacted, compacted, last_ts_of, map_of, release_of, unpack

_NEVER = float("-inf")


class Upkeep(Indexes):
    """The indexes, plus what bounds their memory, and the one rule that lets memory go.

    The horizon rule (exact, per side): a decided side is judged in full, whole or from its tombstone
    (a late event, a duplicate, a reused id refused with its evidence), until an event for it comes
    more than `side_horizon_s` of log time after the side's last event. That event retires the side:
    it goes, with its evidence, and a mapped side's id stays in the exact id memory
    (ledger/idmemory.py): a map of it is then refused and counted (`reused_after_horizon`), any other
    event counted (`late_after_horizon`); a never-mapped side's key is new again. The rule reads only
    the side's own events, so every bound below and every partitioning gives the same answer.

    The compaction rule: a side may be compacted only when no later event can change a decision
    or a finding about it, unless what the side becomes still answers that event the same way.
    A live or never-mapped, unexpired side is never compacted (later events decide it). A decided
    mapped side becomes a `Compacted` tombstone (ledger/tombstone.py): a later event recalls it
    whole enough to judge (late, duplicate or reused id, with the same evidence and detail), and a
    merged audit reads its decision and arrival (premature_release) from it. A side with evidence
    (see `has_evidence`) stays whole when the caller keeps evidence (replay, the service).

    The memory bound, by time: tombstones live in two generations; `forget_decided(before_ts)` retires
    the older one once all of it is past its horizon by `arrival_lag_s` more (its newest last event
    before `before_ts - side_horizon_s - arrival_lag_s`). So tombstones follow the rate of transfers
    times the horizon, never the log's length. Exact for every event that comes less than
    `arrival_lag_s` behind the compaction's clock; an event for a retired id that comes later than that
    (a clock or a merge that far behind) may find its tombstone retired before its horizon: it is
    counted in `behind_horizon`, and a replay warns. Only then can a bound change an answer.
    """

    def __init__(self) -> None:
        super().__init__()
        self.side_horizon_s = SIDE_HORIZON_S
        """The horizon rule's length (log seconds after a decided side's last event)."""
        self.arrival_lag_s = ARRIVAL_LAG_S
        """How far behind the compaction's clock an event may come and still be judged exactly."""
        self.tombstones: dict[Key, Compacted] = {}
        """Compacted sides, newest generation; it becomes `tombstones_old` when the old one is retired."""
        self.tombstones_old: dict[Key, Compacted] = {}
        self.tombstones_newest_ts = _NEVER
        """The newest last-event ts in `tombstones` (and below, in `tombstones_old`)."""
        self.tombstones_old_newest_ts = _NEVER
        self.orphan_tombstones: dict[Key, TransferState] = {}
        """Never-mapped sides that expired, compacted whole (their early events decide a late map:
        released at once, or failed by an early fail), newest generation; retired by time as the
        tombstones are (their keys are then new again: the horizon rule)."""
        self.orphan_tombstones_old: dict[Key, TransferState] = {}
        self.orphans_newest_ts = _NEVER
        self.orphans_old_newest_ts = _NEVER
        self.id_memory: IdMemory | None = None
        """Ids of mapped sides retired (created at the first retirement): exact."""
        self.tombstones_retired = 0
        """Tombstones retired past their horizon (their ids are in the id memory)."""
        self.orphans_retired = 0
        """Compacted never-mapped sides retired past their horizon."""
        self.retired_through = _NEVER
        """The latest ts up to which a side retired by the memory bound (not by an event) may still have
        been inside its horizon: an event for a retired id at or before it is `behind_horizon`."""
        self.late_after_horizon = 0
        """Events other than maps for mapped sides retired past their horizon (counted: the rule)."""
        self.reused_after_horizon = 0
        """Maps refused because their id was mapped before, its side retired past its horizon."""
        self.behind_horizon = 0
        """Events for retired ids that came more than `arrival_lag_s` behind: the one inexact case."""
        self.compacted_by_phase: dict[str, int] = {}
        self.compacted_by_mode: dict[str, int] = {}
        self.retired_sides: dict[Key, TransferState] | None = None
        """When a dict (a replay sets one per chunk), whole sides retired by an event, kept until the caller
        has read the releases of the chunk (a side decided and retired in one chunk); not state."""

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
        older than that go. Each becomes a tombstone (retired by time: `retire_older`); phase and
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
        transfers = self.transfers
        while decided and decided[0][0] < before_ts:
            _, source, transfer_id, t = decided.popleft()
            if not t.closed:
                continue  # an orphan expired, then mapped after all: its decision will come again
            if transfers.get((source, transfer_id)) is not t:
                continue  # retired by its horizon since (its id may name a new side now)
            last = t.last
            if last is not None and last.ts >= before_ts:
                decided.append((last.ts, source, transfer_id, t))  # a late event came: keep it visible a little longer
                continue
            key = (source, transfer_id)
            if keep_evidence and self.has_evidence(key):
                continue
            dropped += self._forget(key, t)
        self.retire_older(before_ts - self.side_horizon_s - self.arrival_lag_s)
        return dropped

    def retire_older(self, cutoff: float) -> None:
        """Retire each older generation of compacted sides whose every side's last event is before
        `cutoff`, then start a new generation (the memory bound; see `Upkeep`)."""
        if self.tombstones_old and self.tombstones_old_newest_ts < cutoff:
            memory = self.id_memory
            if memory is None:
                memory = self.id_memory = IdMemory()
            expired = self.expired_producers
            for source, transfer_id in self.tombstones_old:
                memory.add(source, transfer_id)
                if expired:
                    expired.pop((source, transfer_id), None)
            self.tombstones_retired += len(self.tombstones_old)
            self._retired_upto(self.tombstones_old_newest_ts)
            self.tombstones_old = {}
        if not self.tombstones_old and self.tombstones:
            self.tombstones_old, self.tombstones = self.tombstones, {}
            self.tombstones_old_newest_ts, self.tombstones_newest_ts = self.tombstones_newest_ts, _NEVER
        if self.orphan_tombstones_old and self.orphans_old_newest_ts < cutoff:
            self.orphans_retired += len(self.orphan_tombstones_old)
            self._retired_upto(self.orphans_old_newest_ts)
            self.orphan_tombstones_old = {}
        if not self.orphan_tombstones_old and self.orphan_tombstones:
            self.orphan_tombstones_old, self.orphan_tombstones = self.orphan_tombstones, {}
            self.orphans_old_newest_ts, self.orphans_newest_ts = self.orphans_newest_ts, _NEVER

    def _retired_upto(self, newest_ts: float) -> None:
        through = newest_ts + self.side_horizon_s
        if through > self.retired_through:
            self.retired_through = through

    def _forget(self, key: Key, t: TransferState) -> bool:
        """Compact one decided side; False (kept whole) when its numbers do not fit a tombstone."""
        m, decision = t.map_event, t.decision
        tomb: Compacted | None = None
        if m is not None and decision is not None:
            try:
                tomb = compacted(m, decision, t.arrived_ts, t.arrived_seq, t.events, t.last_ts)
            except (OverflowError, struct.error):
                return False  # integers past 64 bits (no valid event has them): kept whole, as evidence
        self._drop_side(key)
        # The evidence indexes are usually empty: skip hashing the key into them.
        if self.anomalous:
            self.anomalous.pop(key, None)
        if self.double_owned:
            self.double_owned.pop(key, None)
        if self.orphans_expired:
            self.orphans_expired.pop(key, None)
        last_ts = t.last_ts
        if tomb is not None:
            self.tombstones[key] = tomb
            if last_ts > self.tombstones_newest_ts:
                self.tombstones_newest_ts = last_ts
        else:
            self.orphan_tombstones[key] = t
            if last_ts > self.orphans_newest_ts:
                self.orphans_newest_ts = last_ts
        phase = t.phase
        by_phase, by_mode = self.compacted_by_phase, self.compacted_by_mode
        by_phase[phase] = by_phase.get(phase, 0) + 1
        mode = t.mode or "unmapped"
        by_mode[mode] = by_mode.get(mode, 0) + 1
        return True

    def _tombstone(self, key: Key) -> Compacted | None:
        tomb = self.tombstones.get(key)
        return tomb if tomb is not None else self.tombstones_old.get(key)

    def _recall(self, key: Key, ts: float) -> TransferState | None:
        """Bring a compacted side back into `transfers` because an event for it came at `ts`; None when
        that event is past the side's horizon (the side is retired instead: `_retire`)."""
        tomb = self.tombstones.get(key)
        old = tomb is None
        if old:
            tomb = self.tombstones_old.get(key)
        if tomb is not None:
            if ts > last_ts_of(tomb) + self.side_horizon_s:
                del (self.tombstones_old if old else self.tombstones)[key]
                self._retired(key)
                return None
            del (self.tombstones_old if old else self.tombstones)[key]
            t = _rebuilt(key, tomb)
        else:
            orphan = self.orphan_tombstones.pop(key, None)
            t = orphan if orphan is not None else self.orphan_tombstones_old.pop(key)
            if ts > t.last_ts + self.side_horizon_s:
                self.orphans_retired += 1
                return None  # counted as compacted already, its key new again
            self.orphans_expired[key] = None
        self._put_side(key, t)
        self.compacted_by_phase[t.phase] -= 1  # counted whole again (summaries add both)
        self.compacted_by_mode[t.mode or "unmapped"] -= 1
        self.decided.append((ts, key[0], key[1], t))
        return t

    def _retired(self, key: Key) -> None:
        """A tombstone retired by an event past its horizon (its side still counted as compacted)."""
        memory = self.id_memory
        if memory is None:
            memory = self.id_memory = IdMemory()
        memory.add(key[0], key[1])
        self.tombstones_retired += 1
        if self.expired_producers:
            self.expired_producers.pop(key, None)

    def _retire(self, t: TransferState) -> None:
        """A whole decided side retired by an event past its horizon: it goes with its evidence, counted
        as compacted, and a mapped side's id stays in the id memory."""
        key = (t.source, t.transfer_id)
        self._drop_side(key)
        if self.retired_sides is not None:
            self.retired_sides[key] = t
        for index in (self.anomalous, self.double_owned, self.orphans_expired, self.expired_producers):
            if index:
                index.pop(key, None)  # type: ignore[attr-defined]
        if self.unmapped:
            self.unmapped.pop(key, None)
        by_phase, by_mode = self.compacted_by_phase, self.compacted_by_mode
        by_phase[t.phase] = by_phase.get(t.phase, 0) + 1
        mode = t.mode or "unmapped"
        by_mode[mode] = by_mode.get(mode, 0) + 1
        if t.role is not None:
            memory = self.id_memory
            if memory is None:
                memory = self.id_memory = IdMemory()
            memory.add(key[0], key[1])

    def _after_horizon(self, event: Event) -> None:
        """An event for a mapped side retired past its horizon: a map is refused, anything else is late;
        both are counted (the horizon rule). One that came so far behind that its side may have been
        retired before its horizon is counted in `behind_horizon` too (the one inexact case)."""
        if event.ts <= self.retired_through:
            self.behind_horizon += 1
        if type(event) is Map:
            self.reused_after_horizon += 1
        else:
            self.late_after_horizon += 1

    # -- queries ------------------------------------------------------------

    def was_mapped(self, key: Key) -> bool:
        """Whether a map of `key` would be refused: the side was mapped, live, decided, compacted or
        retired (the exact id memory)."""
        t = self.transfers.get(key)
        if t is not None:
            return t.role is not None
        if self._tombstone(key) is not None:
            return True
        memory = self.id_memory
        return memory is not None and memory.contains(key[0], key[1])

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
        arrived_ts=numbers.arrived_ts,
        arrived_seq=numbers.arrived_seq,
    )
