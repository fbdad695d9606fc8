"""The indexes the fold keeps beside its sides, and the queries the audits and shells ask of them:
which sides are live or never mapped, who holds each block (claims, double ownership), when each live
side is due (a deadline heap), which sides carry evidence for a finding. Sans-IO; every update is
O(1) or O(blocks of the side), so an event's cost does not grow with the number of sides."""

from __future__ import annotations

from collections import deque
from heapq import heapify, heappush

from kvledger.ledger.decisions import Key
from kvledger.ledger.events import ReqId, TransferId
from kvledger.ledger.limits import DEADLINE_HEAP_SLACK, EVIDENCE_SEQS_MAX
from kvledger.ledger.side import TransferState, due_at

DeadlineEntry = tuple[float, int, str, TransferId, TransferState]
"""(deadline, map seq, source, transfer id, side): ordered by the first four, which no two entries share (a
side pushes a deadline only later than its current one), so the side itself is never compared."""

GONE = TransferState()
"""The side of a restored deadline entry whose side was forgotten (never mapped: never due, swept)."""


def _note(seqs: list[int] | None, seq: int) -> list[int]:
    if seqs is None:
        return [seq]
    if len(seqs) < EVIDENCE_SEQS_MAX:
        seqs.append(seq)
    return seqs


class Indexes:
    """The sides of one log (or of several merged) and the indexes over them."""

    def __init__(self) -> None:
        self.transfers: dict[Key, TransferState] = {}
        self.sides_of: dict[str, dict[TransferId, TransferState]] = {}
        """Per source, transfer id -> side: `transfers` again, for the fold's lookup of every event, which
        this saves building and hashing a key tuple (a third of a compiled event's cost was that lookup).
        Kept with `transfers` by `_put_side` and `_drop_side` only; `put_sides` builds both whole."""
        self.live: dict[Key, TransferState] = {}
        """Mapped, undecided: the sides holding blocks."""
        self.unmapped: dict[Key, TransferState] = {}
        """Events seen, no map yet; ordered by first sight for the orphan audit."""
        self.deadlines: list[DeadlineEntry] = []
        """Heap of the deadlines of live sides, each entry holding its side: an entry is current while
        `due_at(side)` is its deadline; stale ones (decided, or moved by a lease) are skipped and swept
        when they dominate. The side, not a lookup by key: a sweep reads each entry's side directly (a
        lookup in `sides_of` per entry was most of a sweep's cost). So a stale entry keeps its side alive
        until the next sweep, forgotten or not: at most DEADLINE_HEAP_SLACK times the live sides (plus 16)
        entries in all, a bound that follows live transfers as the rest of the fold's memory does."""
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
        self.decided: deque[tuple[float, str, TransferId, TransferState]] = deque()
        """(decision ts, source, transfer id, side) in decision order: what `forget_decided` pops from, O(1)
        per side. Holds only sides still in `transfers` (`compact` filters it). Flat, not (ts, key, side):
        a tuple holding only strings and floats is untracked by the collector once it has looked at it, and
        the nested key tuple kept every entry tracked (four times the full collections in a long replay)."""
        self.blocks_held = 0
        """Blocks held by live sides, each claim counted once."""
        self.found_by_code: dict[str, int] = {}
        """Findings counted when first found, by audit code: a side's first late, duplicate, over-ack and
        reused-id event (`late_event`, `duplicate`, `over_ack`, `id_reuse`) and a never-mapped side's expiry
        (`orphan_ack`). Forgetting a side never lowers them, and a side compacted and then recalled by another
        such event is not counted again (its tombstone keeps which it had: ledger/tombstone.py), so a running
        ledger that forgets decided sides counts what an audit of its whole log reports. Rule S's findings
        (events of a stamped id past its window, ledger/upkeep.py) are counted once per side too."""

    def grown_containers(self) -> list[object]:
        """The containers that grow with the fold, each holding only atomic values (keys, numbers, sides
        and deadline or decision tuples of them): what `kvledger.ledger.collector.untrack` may keep out of the
        collector's passes. The others hold lists, or stay small."""
        return [self.transfers, *self.sides_of.values(), self.live, self.unmapped, self.deadlines,
                self.decided, *self.held.values()]  # fmt: skip

    # -- the sides -------------------------------------------------------

    def _put_side(self, key: Key, t: TransferState) -> None:
        """`t` is the side of `key` (in `transfers` and `sides_of`: the only way a side comes in)."""
        self.transfers[key] = t
        by_id = self.sides_of.get(key[0])
        if by_id is None:
            by_id = self.sides_of[key[0]] = {}
        by_id[key[1]] = t

    def _drop_side(self, key: Key) -> None:
        """The side of `key` goes (from both; the only way one goes)."""
        del self.transfers[key]
        del self.sides_of[key[0]][key[1]]

    def put_sides(self, sides: list[TransferState]) -> None:
        """`transfers` and `sides_of` hold exactly `sides`, in their order (a snapshot's decoding: one pass,
        each key built from its side's C fields when compiled)."""
        self.transfers = {}
        self.sides_of = {}
        for t in sides:
            self._put_side((t.source, t.transfer_id), t)

    def put_decided(self, entries: list[tuple[float, int]], sides: list[TransferState]) -> None:
        """`decided` holds, in the order of `entries`, each (decision ts, index into `sides`) as the side it
        names (a snapshot's decoding writes `decided` so: no key to build and hash per entry)."""
        decided: deque[tuple[float, str, TransferId, TransferState]] = deque()
        append = decided.append
        for ts, i in entries:
            t = sides[i]
            append((ts, t.source, t.transfer_id, t))
        self.decided = decided

    # -- block claims ----------------------------------------------------

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

    # -- evidence ----------------------------------------------------------

    def _found(self, code: str) -> None:
        """A finding of `code` found for the first time on its side (`found_by_code`)."""
        found = self.found_by_code
        found[code] = found.get(code, 0) + 1

    def _duplicate(self, t: TransferState, seq: int) -> None:
        if t.duplicate_seqs is None:
            self._found("duplicate")
        t.duplicate_seqs = _note(t.duplicate_seqs, seq)
        self.anomalous[t.key] = None

    def _late(self, t: TransferState, seq: int) -> None:
        if t.late_seqs is None:
            self._found("late_event")
        t.late_seqs = _note(t.late_seqs, seq)
        self.anomalous[t.key] = None

    def _refused_map(self, t: TransferState, seq: int, request_id: ReqId) -> None:
        """A second map of a mapped side, whatever its phase (a transfer id is single-use per side): a
        duplicate when it names the same request, else a reused id naming the request refused."""
        if t.request_id == request_id:
            if t.duplicate_seqs is None:
                self._found("duplicate")
            t.duplicate_seqs = _note(t.duplicate_seqs, seq)
        else:
            if t.reuse_seqs is None:
                self._found("id_reuse")
            t.reuse_seqs = _note(t.reuse_seqs, seq)
            if t.reused_by is None:
                t.reused_by = [request_id]
            elif len(t.reused_by) < EVIDENCE_SEQS_MAX:
                t.reused_by.append(request_id)
        self.anomalous[t.key] = None

    def _over_ack(self, t: TransferState, seq: int) -> None:
        if t.over_ack_seqs is None:
            self._found("over_ack")
        t.over_ack_seqs = _note(t.over_ack_seqs, seq)
        self.anomalous[t.key] = None

    # -- deadlines ---------------------------------------------------------

    def _push_deadline(self, deadline: float, map_seq: int, t: TransferState) -> None:
        """A live side's (new) deadline; stale entries are swept once they dominate the heap."""
        # The name imported, not `heapq.heappush`: compiled, a module attribute lookup was a tenth of a map's push.
        heappush(self.deadlines, (deadline, map_seq, t.source, t.transfer_id, t))
        if len(self.deadlines) > DEADLINE_HEAP_SLACK * (len(self.live) + 16):
            self._sweep_deadlines()

    def _sweep_deadlines(self) -> None:
        kept: list[DeadlineEntry] = []
        for d in self.deadlines:
            t = d[4]
            if due_at(t) == d[0]:
                kept.append(d)
        heapify(kept)
        self.deadlines = kept

    def put_deadlines(self, entries: list[tuple[float, int, str, TransferId]]) -> None:
        """`deadlines` holds `entries` (deadline, map seq, source, transfer id), in their order (a heap
        stays one), each with its side from `sides_of` (a snapshot writes entries without their sides).
        An entry whose side is gone, or is a later mapping of its id, gets `GONE`: stale, as it was."""
        heap: list[DeadlineEntry] = []
        append = heap.append
        sides_of = self.sides_of
        for deadline, map_seq, source, transfer_id in entries:
            by_id = sides_of.get(source)
            t = None if by_id is None else by_id.get(transfer_id)
            if t is None or t.map_seq != map_seq:
                t = GONE
            append((deadline, map_seq, source, transfer_id, t))
        self.deadlines = heap

    # -- queries used by the audits and the shells ----------------------------

    def due(self, now: float) -> list[TransferState]:
        """Live sides whose deadline is at or before `now`, earliest first.

        Walks only the heap nodes at or before `now` (and their children), so the
        cost follows the number due, not the number live. Does not mutate.
        """
        heap = self.deadlines
        if not heap or heap[0][0] > now:
            return []  # the root is the earliest deadline: nothing due (the clock tick's common answer)
        found: list[tuple[float, int, TransferState]] = []
        stack = [0] if heap else []
        while stack:
            i = stack.pop()
            deadline, seq, _, _, t = heap[i]
            if deadline > now:
                continue
            if due_at(t) == deadline:
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

    def has_evidence(self, key: Key) -> bool:
        """Whether an audit reports the side, or may: late, duplicate, over-ack or reuse events, an
        expired orphan, a producer released by expire, or a consumer of a transfer whose producer was
        (the pair a premature_release is made of). Kept whole by a caller that keeps evidence (a replay),
        such a side stays until the audit reads it. Each is about the side's own transfer: a double-owned
        block is not evidence here (only a live side is reported for it, and a decided side is what
        compaction takes), so what a replay keeps does not depend on other transfers
        (kvledger.ledger.partitioned)."""
        # Usually all empty: a key tuple is hashed into each only when it holds something (a replay's
        # compaction asks this of every side it forgets).
        if (self.anomalous and key in self.anomalous) or (self.orphans_expired and key in self.orphans_expired):
            return True
        expired = self.expired_producers
        if not expired:
            return False
        if key in expired:
            return True
        tid = key[1]
        return any((source, tid) in expired for source in self.sources)
