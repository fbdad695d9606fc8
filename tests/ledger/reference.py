"""A reference model of the fold and the audit, written again from the rules, for property tests.

Deliberately simple and independent of `ledger/fold.py` and `ledger/audit.py`: it keeps the raw
events of each side in a list and, after every event, judges that side again from its whole list
(plain sets, no bitmasks, no caches, no fast paths, no indexes, no compaction). What it shares
with the fold is only the event types, the `Release`/`Finding` value types it builds to compare,
and the named limits the rules are stated in (layer and rank ranges, the evidence cap). It decides
severities with its own table.

The rules, as README.md ("The decisions", "Audits") and the fold's docstrings state them:

- A side is `(source, transfer_id)`; its first `map` makes it mapped (role, mode, blocks). Any later
  map of a mapped side is refused: same request id a duplicate, another an id reuse.
- A mapped side is decided once: `failed` by a consumer holding more blocks than the producer sent
  (at its map), by a terminal fail (one before the map fails it at the map); `expired` by an expire
  (a side whose never-mapped events were expired is decided `expired` when its map comes);
  `completed` when its evidence is complete (`_complete`).
- Events after the decision change nothing and are late; a never-mapped side that expired takes
  later expires silently, anything else as late (a map still maps it, then decides it).
- Duplicates: a second ack of a rank, of recv, of the whole transfer or of a layer already acked;
  a second first-try schedule of the whole transfer or of a layer; an early ack of a layer already
  acked early; a seal naming another count than the last one (an identical seal is not a duplicate).
- Over-ack: a layer or rank number out of range; an ack kind the side does not receive; an ack of
  a layer not scheduled yet on a mapped side; a layered ack or a seal after which more layers are
  acked than sealed. One evidence entry per rule broken, so one event may appear twice.
- Findings at `now`: a live side is a leak from its deadline on (deadline <= now), else stuck after
  more than the transfer timeout without an event; a never-mapped side is an orphan from exactly the
  transfer timeout after its first event, or once expired; two live sides of a source holding one
  block are a double owner (on the later one, naming the longest-held other); a producer released by
  expire is a premature release when a consumer of its transfer finished reading more than the clock
  skew later; evidence lists give late, over-ack, id-reuse and duplicate findings.

Where the README says less than the fold does, the reference follows the fold: an ack kind a side does
not receive is over-ack evidence *and* still counts (a layered read ack towards a WRITE producer's
layers, a whole write ack as a READ consumer's whole ack), and a READ consumer also completes when
its sealed layer count is acked.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import msgspec

from kvledger.ledger.audit import Finding
from kvledger.ledger.decisions import Release
from kvledger.ledger.events import Ack, Event, Expire, Fail, Map, Schedule, Seal
from kvledger.ledger.humanize import duration, utc
from kvledger.ledger.limits import EVIDENCE_SEQS_MAX, LAYERS_MAX, RANKS_MAX

Key = tuple[str, str]

SEVERITY: dict[str, str] = {
    # Blocks at risk or a broken promise: the CLI fails on these by default.
    "leak": "error",
    "double_owner": "error",
    "premature_release": "error",
    "id_reuse": "error",
    # Something is off but no block is wrongly held or freed by it.
    "stuck": "warning",
    "orphan_ack": "warning",
    "late_event": "warning",
    "over_ack": "warning",
    # Redelivery: information only.
    "duplicate": "info",
}

RECEIVES: dict[tuple[str, str], frozenset[str]] = {
    ("producer", "read"): frozenset({"release"}),
    ("producer", "write"): frozenset({"write", "release"}),
    ("consumer", "read"): frozenset({"read", "recv"}),
    ("consumer", "write"): frozenset({"write", "recv"}),
}
"""The ack kinds each (role, mode) expects: producers see writes and releases, consumers reads and recv."""


@dataclass
class Verdict:
    """What one side's events say, judged from the first event every time."""

    key: Key
    events: list[Event]
    mapped: Map | None = None
    decision: Release | None = None
    decided_at: int = -1
    """Index (in `events`) of the event that decided the side; -1 while undecided."""
    mapped_at: int = -1
    orphan_expired: bool = False
    phase: str = "unmapped"
    scheduled: set[int] = field(default_factory=set)
    whole_scheduled: bool = False
    acked: set[int] = field(default_factory=set)
    early: set[int] = field(default_factory=set)
    whole_acked: bool = False
    ranks: set[int] = field(default_factory=set)
    recv: bool = False
    expected: int | None = None
    pending_fail: tuple[str, str] | None = None
    """The first terminal fail before the map: (reason, code)."""
    arrived: tuple[float, int] | None = None
    late: list[int] = field(default_factory=list)
    duplicate: list[int] = field(default_factory=list)
    over_ack: list[int] = field(default_factory=list)
    reuse: list[int] = field(default_factory=list)
    reused_by: list[str] = field(default_factory=list)

    @property
    def live(self) -> bool:
        return self.mapped is not None and self.decision is None

    @property
    def closed(self) -> bool:
        return self.decision is not None or self.orphan_expired


def _note(seqs: list[int], seq: int) -> None:
    if len(seqs) < EVIDENCE_SEQS_MAX:
        seqs.append(seq)


def _in_range(numbers: Iterable[int], bound: int) -> bool:
    return all(0 <= n < bound for n in numbers)


def _complete(v: Verdict) -> bool:
    """The release rule of a mapped side: is its evidence complete?"""
    m = v.mapped
    assert m is not None
    released = len(v.ranks) >= m.acks_expected
    all_layers = v.expected is not None and len(v.acked) >= v.expected
    if m.role == "producer":
        return released if m.mode == "read" else all_layers or released
    if m.mode == "write":
        return v.recv
    return v.recv or v.whole_acked or all_layers


def _advance(phase: str) -> str:
    return "active" if phase == "held" else phase


def judge(key: Key, events: list[Event]) -> Verdict:
    """The side `key` after `events` (its own, in log order)."""
    v = Verdict(key, events)

    def decide(i: int, e: Event, cause: str, reason: str, why: str) -> None:
        m = v.mapped
        assert m is not None and v.decision is None
        v.decision = Release(
            m.source,
            m.transfer_id,
            m.request_id,
            m.role,
            m.mode,
            m.block_ids,
            cause,
            e.seq,
            e.ts,
            reason,
            why,  # type: ignore[arg-type]
        )
        v.decided_at = i
        v.phase = cause
        if cause == "completed" and m.role == "consumer" and v.arrived is None:
            v.arrived = (e.ts, e.seq)

    for i, e in enumerate(events):
        if isinstance(e, Map) and v.mapped is not None:
            # Refused, live or decided: an id is single-use per side; never late.
            if e.request_id == v.mapped.request_id:
                _note(v.duplicate, e.seq)
            else:
                _note(v.reuse, e.seq)
                if len(v.reused_by) < EVIDENCE_SEQS_MAX:
                    v.reused_by.append(e.request_id)
            continue
        if v.closed:
            if v.mapped is None and isinstance(e, Expire):
                continue  # a never-mapped side expired again: nothing new
            _note(v.late, e.seq)
            if not isinstance(e, Map):
                continue
            # The map of a side given up before it came: it maps, and is decided at once.
        if isinstance(e, Map):
            v.mapped, v.mapped_at = e, i
            v.phase = "sealed" if v.expected is not None else "active" if v.scheduled or v.whole_scheduled else "held"
            v.acked |= v.early & v.scheduled
            v.early -= v.scheduled
            remote = e.remote_block_ids
            if e.role == "consumer" and remote is not None and len(e.block_ids) > len(remote):
                decide(i, e, "failed", "local_blocks_exceed_remote", "local_exceeds_remote")
            elif v.pending_fail is not None:
                decide(i, e, "failed", *v.pending_fail)
            elif v.orphan_expired:
                decide(i, e, "expired", "expired before its map arrived", "expired_before_map")
            elif _complete(v):
                decide(i, e, "completed", "", "completed")
            continue
        if isinstance(e, Fail):
            if e.retryable:
                continue
            if v.mapped is None:
                if v.pending_fail is None:
                    v.pending_fail = (e.reason, e.code)
            else:
                decide(i, e, "failed", e.reason, e.code)
            continue
        if isinstance(e, Expire):
            if v.mapped is None:
                v.orphan_expired = True
                v.phase = "expired"
            else:
                decide(i, e, "expired", f"{e.deadline} deadline passed", "deadline")
            continue
        if isinstance(e, Schedule):
            first_try = not e.deferred and e.attempt == 0
            if e.layers is None:
                if v.whole_scheduled and first_try:
                    _note(v.duplicate, e.seq)
                v.whole_scheduled = True
            elif not _in_range(e.layers, LAYERS_MAX):
                _note(v.over_ack, e.seq)
                continue
            else:
                layers = set(e.layers)
                if layers & v.scheduled and first_try:
                    _note(v.duplicate, e.seq)
                v.scheduled |= layers
                v.acked |= v.early & v.scheduled
                v.early -= v.scheduled
            if v.mapped is not None:
                v.phase = _advance(v.phase)
        elif isinstance(e, Seal):
            if v.expected is not None and v.expected != e.expected:
                _note(v.duplicate, e.seq)
            v.expected = e.expected
            if len(v.acked) > e.expected:
                _note(v.over_ack, e.seq)
            if v.mapped is not None:
                v.phase = "sealed"
        elif isinstance(e, Ack):
            if e.what == "release":
                if not 0 <= e.rank < RANKS_MAX:
                    _note(v.over_ack, e.seq)
                    continue
                if e.rank in v.ranks:
                    _note(v.duplicate, e.seq)
                v.ranks.add(e.rank)
            elif e.what == "recv":
                if v.recv:
                    _note(v.duplicate, e.seq)
                v.recv = True
                v.arrived = v.arrived or (e.ts, e.seq)
            elif e.layers is None:
                if v.whole_acked:
                    _note(v.duplicate, e.seq)
                v.whole_acked = True
                if e.what == "read":
                    v.arrived = v.arrived or (e.ts, e.seq)
            elif not _in_range(e.layers, LAYERS_MAX):
                _note(v.over_ack, e.seq)
            else:
                layers = set(e.layers)
                if layers & v.acked:
                    _note(v.duplicate, e.seq)
                fresh = layers - v.acked
                v.acked |= fresh & v.scheduled
                early = fresh - v.scheduled
                if early:
                    if early & v.early:
                        _note(v.duplicate, e.seq)
                    v.early |= early
                    if v.mapped is not None:
                        _note(v.over_ack, e.seq)
                if v.expected is not None and len(v.acked) > v.expected:
                    _note(v.over_ack, e.seq)
            if v.mapped is not None and e.what not in RECEIVES[(v.mapped.role, v.mapped.mode)]:
                _note(v.over_ack, e.seq)
        if v.mapped is not None and _complete(v):
            decide(i, e, "completed", "", "completed")
    return v


@dataclass
class Reference:
    """Every decision and finding of a stream of events, recomputed from the events alone."""

    events: list[Event]
    verdicts: dict[Key, Verdict] = field(default_factory=dict)
    releases: list[Release] = field(default_factory=list)
    claims: dict[Key, list[tuple[int, Key]]] = field(default_factory=dict)
    """Side -> (block, the longest-held live side of its source holding it too) at the side's map."""
    sources: list[str] = field(default_factory=list)
    mapped_order: dict[Key, int] = field(default_factory=dict)
    """Side -> the position in `events` of its accepted map."""

    def __post_init__(self) -> None:
        by_side: dict[Key, list[Event]] = {}
        mapped_order = self.mapped_order
        for n, e in enumerate(self.events):
            key = (e.source, e.transfer_id)
            if e.source not in self.sources:
                self.sources.append(e.source)
            side = by_side.setdefault(key, [])
            side.append(e)
            v = judge(key, side)
            last = len(side) - 1
            if v.mapped_at == last:
                mapped_order[key] = n
                held = [
                    other for other in self.verdicts.values()
                    if other.key != key and other.key[0] == key[0] and other.live
                ]  # fmt: skip
                held.sort(key=lambda other: mapped_order[other.key])
                for block in v.mapped.block_ids:  # type: ignore[union-attr]
                    owner = next((other for other in held if block in other.mapped.block_ids), None)  # type: ignore[union-attr]
                    if owner is not None:
                        self.claims.setdefault(key, []).append((block, owner.key))
            if v.decided_at == last:
                assert v.decision is not None
                self.releases.append(v.decision)
            self.verdicts[key] = v

    def holders(self, source: str) -> dict[int, list[Key]]:
        """Block -> the live sides of `source` holding it, longest held first."""
        out: dict[int, list[Key]] = {}
        live = [v for v in self.verdicts.values() if v.key[0] == source and v.live]
        for v in sorted(live, key=lambda v: self.mapped_order[v.key]):
            for block in v.mapped.block_ids:  # type: ignore[union-attr]
                out.setdefault(block, []).append(v.key)
        return out

    def findings(self, now: float, *, transfer_timeout_s: float = 30.0, clock_skew_s: float = 0.5) -> list[Finding]:
        """Every finding at `now`, in no particular order (compare with `canonical`)."""
        out: list[Finding] = []
        for v in self.verdicts.values():
            out.extend(_side_findings(v, now, transfer_timeout_s))
            for block, other_key in self.claims.get(v.key, []):
                other = self.verdicts[other_key]
                if v.live and other.live:
                    assert v.mapped is not None and other.mapped is not None
                    out.append(
                        _finding(
                            "double_owner",
                            v,
                            (other.mapped.seq, v.mapped.seq),
                            f"block {block} also held by live transfer {other.key[1]}",
                        )
                    )
            out.extend(self._premature(v, clock_skew_s))
        return out

    def _premature(self, producer: Verdict, clock_skew_s: float) -> list[Finding]:
        d = producer.decision
        if d is None or d.role != "producer" or d.cause != "expired":
            return []
        out = []
        for source in self.sources:
            consumer = self.verdicts.get((source, producer.key[1]))
            if consumer is None or consumer.mapped is None or consumer.mapped.role != "consumer":
                continue
            if consumer.arrived is None or consumer.arrived[0] - d.ts <= clock_skew_s:
                continue
            arrived_ts, arrived_seq = consumer.arrived
            out.append(
                _finding(
                    "premature_release",
                    producer,
                    (d.seq, arrived_seq),
                    f"released by expire at {utc(d.ts, digits=6)}; consumer {source} finished "
                    f"reading {duration(arrived_ts - d.ts)} later (seq {arrived_seq} there)",
                )
            )
        return out


def _count(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _finding(code: str, v: Verdict, evidence: tuple[int, ...], detail: str) -> Finding:
    m = v.mapped
    return Finding(
        code=code,
        severity=SEVERITY[code],  # type: ignore[arg-type]
        source=v.key[0],
        transfer_id=v.key[1],  # type: ignore[arg-type]
        request_id=m.request_id if m is not None else None,
        block_ids=m.block_ids if m is not None else (),
        evidence=evidence,
        detail=detail,
    )


def _side_findings(v: Verdict, now: float, timeout: float) -> list[Finding]:
    out: list[Finding] = []
    first, last, m = v.events[0], v.events[-1], v.mapped
    if v.live:
        assert m is not None
        if m.deadline <= now:
            out.append(
                _finding(
                    "leak",
                    v,
                    (m.seq,),
                    f"{_count(len(m.block_ids), 'block')} held {duration(now - m.deadline)} past the deadline, "
                    "no decision",
                )
            )
        elif now - last.ts > timeout:
            out.append(
                _finding(
                    "stuck",
                    v,
                    (m.seq, last.seq),
                    f"no event for {duration(now - last.ts)} (over the transfer timeout, {duration(timeout)}) "
                    f"in phase {v.phase}",
                )
            )
    never_mapped = f"{_count(len(v.events), 'event')} for a transfer never mapped"
    if v.orphan_expired:
        out.append(_finding("orphan_ack", v, (first.seq, last.seq), f"{never_mapped}: expired before any map"))
    elif m is None and now - first.ts >= timeout:
        out.append(
            _finding("orphan_ack", v, (first.seq, last.seq), f"{never_mapped}: unmapped for {duration(now - first.ts)}")
        )
    if v.late:
        cause = v.decision.cause if v.decision is not None else "expired"
        hint = "; an ack after an expire means the timeout is too short" if cause == "expired" else ""
        late = f"{_count(len(v.late), 'event')} after the {cause} decision{hint}"
        out.append(_finding("late_event", v, tuple(v.late), late))
    if v.over_ack:
        out.append(
            _finding(
                "over_ack",
                v,
                tuple(v.over_ack),
                f"acks beyond what was scheduled or sealed (expected {v.expected}, acked {len(v.acked)})",
            )
        )
    if v.reuse:
        assert m is not None
        held = "holds it" if v.live else f"held it (released: {v.phase})"
        out.append(
            _finding(
                "id_reuse",
                v,
                (m.seq, *v.reuse),
                f"transfer id mapped again by request {', '.join(v.reused_by)} while {m.request_id} {held}: refused",
            )
        )
    if v.duplicate:
        out.append(_finding("duplicate", v, tuple(v.duplicate), "duplicate ack, schedule, seal or map"))
    return out


def canonical(findings: Iterable[Finding]) -> list[Finding]:
    """Findings in one total order (their encoded bytes), to compare two lists as multisets."""
    return sorted(findings, key=msgspec.json.encode)
