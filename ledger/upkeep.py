"""Memory upkeep: decided sides compacted into tombstones, forgotten in decision order, recalled when
a later event names them, and retired by time once their id is older than the id window. The rules that
keep this from changing any answer are written below, at `Upkeep`; the property tests hold them
(tests/ledger/test_compaction_properties.py, tests/ledger/test_exact_memory.py)."""

from __future__ import annotations

import heapq
import math
import struct
from collections import deque

import msgspec

from kvledger.ledger.decisions import Key
from kvledger.ledger.events import Event, Map, ReqId, TransferId
from kvledger.ledger.ids import issued_at
from kvledger.ledger.indexes import Indexes
from kvledger.ledger.lifecycle import CAUSE_PHASE
from kvledger.ledger.limits import ARRIVAL_LAG_S, EVIDENCE_SEQS_MAX, ID_WINDOW_S
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

_INF = math.inf


def window_end_of(transfer_id: str) -> float:
    """The last event time the id window allows for `transfer_id`: its issue time plus `ID_WINDOW_S` for a
    stamped id (ledger/ids.py), infinity for an unstamped one (held exactly, never judged by time)."""
    issued = issued_at(transfer_id)
    return _INF if issued is None else issued + ID_WINDOW_S


class PastWindow(msgspec.Struct, gc=False, array_like=True):
    """Events of a stamped id past its window (`ts > issued + ID_WINDOW_S`) that found no live side: each
    judged by the event alone, never opening or recalling a side (rule S, `Upkeep`). Maps are refused
    (`id_reuse`), any other event is late (`late_event`). Exact: nothing here depends on what memory holds."""

    source: str
    transfer_id: TransferId
    window_end: float
    map_seqs: list[int]
    late_seqs: list[int]
    maps: int = 0
    late: int = 0
    request_id: ReqId | None = None
    """The first refused map's request."""
    block_ids: tuple[int, ...] = ()
    last_ts: float = 0.0


class Upkeep(Indexes):
    """The indexes, plus what bounds their memory, exactly.

    The compaction rule: a side may be compacted only when no later event can change a decision
    or a finding about it, unless what the side becomes still answers that event the same way.
    A live or never-mapped, unexpired side is never compacted (later events decide it). A decided
    mapped side becomes a `Compacted` tombstone (ledger/tombstone.py): a later event recalls it
    whole enough to judge (late, duplicate or reused id, with the same evidence and detail), and a
    merged audit reads its decision and arrival (premature_release) from it. A never-mapped side
    that expired is kept whole (`orphan_tombstones`). A side with evidence (see `has_evidence`)
    stays whole when the caller keeps evidence (replay, the service).

    Rule S, the id window: an event of a stamped id (ledger/ids.py) whose `ts` is past the id's issue
    time plus `ID_WINDOW_S`, and whose side is not held open (undecided), is judged by the event alone
    (`past_window`): a map is refused, anything else is late; no side is opened or recalled. So whether
    the side's tombstone is still held never changes an answer, and a stamped tombstone may be retired
    once the upkeep's clock (`retire`) passes the window plus `arrival_lag_s`. An event of a retired id
    that is still inside its window is more than `arrival_lag_s` behind that clock (impossible in a
    time-ordered log); it is judged as a first sight and counted (`behind_horizon`), and the compaction
    warning says those answers are not exact. Unstamped ids are never retired: exact, at the cost of
    memory that grows with them (`unstamped_held`).
    """

    def __init__(self) -> None:
        super().__init__()
        self.tombstones: dict[Key, Compacted] = {}
        """Compacted mapped sides: exact, every one held until its id is retired (stamped ids only)."""
        self.orphan_tombstones: dict[Key, TransferState] = {}
        """Never-mapped sides that expired, compacted whole (their early events decide a late map inside the
        window: released at once, or failed by an early fail). Exact, retired like the tombstones."""
        self.retire_queue: list[tuple[float, str, TransferId]] = []
        """Heap of (retire time, source, transfer id) of stamped tombstones and orphans: the id's window end
        plus `arrival_lag_s`. An entry whose key was recalled meanwhile finds nothing to retire."""
        self.retired_through = -_INF
        """The latest clock `retire` ran to: an unknown stamped id whose retire time is before it may be a
        retired one (`behind_horizon`)."""
        self.arrival_lag_s = ARRIVAL_LAG_S
        """How far behind the upkeep's clock an event may arrive and still find its side (`ARRIVAL_LAG_S`)."""
        self.behind_horizon = 0
        """Events inside their id's window for a stamped id that may have been retired: judged as first
        sights, not exactly (`ledger.summary.compaction_warning`)."""
        self.unstamped_held = 0
        """Compacted sides of unstamped ids held: never retired, so memory grows with them (stamping bounds it)."""
        self.past_window: dict[Key, PastWindow] = {}
        """Rule S's evidence: per key, the events past its id window (refused maps, late events)."""
        self.settled: dict[Key, Compacted] = {}
        """Retired tombstones a merged audit still reads: producers released by expire and the consumers of
        their transfers (premature_release). Kept for good, like evidence: one per such fault."""
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
        older than that go, and stamped ids are retired up to it (`retire`). Each becomes a
        tombstone; phase and mode counts of compacted sides are kept in `compacted_by_phase` /
        `compacted_by_mode`. Returns how many went.
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
        if decided_before_ts is not None:
            self.retire(decided_before_ts)
        return dropped

    def forget_decided(self, before_ts: float, *, keep_evidence: bool = False) -> int:
        """Compact sides decided before `before_ts` whose last event is older too, in decision order;
        O(1) per side (what a running connector does every step, and a replay between chunks), then
        retire stamped ids up to `before_ts` (`retire`).
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
        self.retire(before_ts)
        return dropped

    def retire(self, now: float) -> int:
        """Retire the tombstones and orphans of stamped ids whose window plus `arrival_lag_s` ended before
        `now` (the upkeep's clock: log time in a replay, the service's clock running). Rule S judges every
        later event of theirs past the window without them. Returns how many went."""
        if now > self.retired_through:
            self.retired_through = now
        queue = self.retire_queue
        retired = 0
        while queue and queue[0][0] < now:
            _, source, transfer_id = heapq.heappop(queue)
            key = (source, transfer_id)
            tomb = self.tombstones.pop(key, None)
            if tomb is not None:
                retired += 1
                if self.expired_producers and self._premature_pair(key):
                    self.settled[key] = tomb
            elif self.orphan_tombstones.pop(key, None) is not None:
                retired += 1
        return retired

    def _premature_pair(self, key: Key) -> bool:
        """Whether a merged audit's premature_release may read `key`: a producer released by expire, or a
        side of the same transfer as one."""
        expired = self.expired_producers
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
            self.tombstones[key] = tomb
        else:
            self.orphan_tombstones[key] = t
        window_end = t.window_end
        if window_end == _INF:
            self.unstamped_held += 1
        else:
            heapq.heappush(self.retire_queue, (window_end + self.arrival_lag_s, key[0], key[1]))
        phase = t.phase
        by_phase, by_mode = self.compacted_by_phase, self.compacted_by_mode
        by_phase[phase] = by_phase.get(phase, 0) + 1
        mode = t.mode or "unmapped"
        by_mode[mode] = by_mode.get(mode, 0) + 1
        return True

    def _tombstone(self, key: Key) -> Compacted | None:
        return self.tombstones.get(key)

    def _recall(self, key: Key, ts: float) -> TransferState:
        """Bring a compacted side back into `transfers` because an event for it came."""
        tomb = self.tombstones.pop(key, None)
        if tomb is not None:
            t = _rebuilt(key, tomb)
        else:
            t = self.orphan_tombstones.pop(key)
            self.orphans_expired[key] = None
        if t.window_end == _INF:
            self.unstamped_held -= 1
        self._put_side(key, t)
        self.compacted_by_phase[t.phase] -= 1  # counted whole again (summaries add both)
        self.compacted_by_mode[t.mode or "unmapped"] -= 1
        self.decided.append((ts, key[0], key[1], t))
        return t

    def _past_window(self, event: Event, window_end: float) -> None:
        """Rule S: an event past its stamped id's window, for a side not held open, judged alone."""
        key = (event.source, event.transfer_id)
        if event.source not in self.sources:
            self.sources[event.source] = None
        record = self.past_window.get(key)
        if record is None:
            record = self.past_window[key] = PastWindow(event.source, event.transfer_id, window_end, [], [])
        record.last_ts = event.ts
        if type(event) is Map:
            if not record.maps:
                self._found("id_reuse")
                record.request_id = event.request_id
                record.block_ids = event.block_ids
            record.maps += 1
            if len(record.map_seqs) < EVIDENCE_SEQS_MAX:
                record.map_seqs.append(event.seq)
        else:
            if not record.late:
                self._found("late_event")
            record.late += 1
            if len(record.late_seqs) < EVIDENCE_SEQS_MAX:
                record.late_seqs.append(event.seq)

    # -- queries ------------------------------------------------------------

    def was_mapped(self, key: Key, ts: float | None = None) -> bool:
        """Whether a map of `key` (at `ts`, when given) would be refused: the side was mapped, live, decided
        or compacted, or its stamped id is past its window at `ts` (rule S)."""
        t = self.transfers.get(key)
        if t is not None:
            if t.role is not None:
                return True
            return ts is not None and t.closed and ts > t.window_end
        if key in self.tombstones:
            return True
        return ts is not None and ts > window_end_of(key[1])

    def side(self, key: Key) -> TransferState | None:
        """The side of `key` as an audit sees it: held whole, or rebuilt (detached) from its tombstone."""
        t = self.transfers.get(key)
        if t is not None:
            return t
        tomb = self._tombstone(key)
        if tomb is None:
            tomb = self.settled.get(key)
        if tomb is not None:
            return _rebuilt(key, tomb)
        return self.orphan_tombstones.get(key)

    @property
    def tombstone_count(self) -> int:
        """Compacted sides held: mapped sides' tombstones and never-mapped sides kept whole."""
        return len(self.tombstones) + len(self.orphan_tombstones)


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
        window_end=window_end_of(key[1]),
    )
    if tomb.found:
        mark_found(t, tomb.found)
    return t
