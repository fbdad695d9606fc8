"""Unkind event histories for property tests: both sides of many overlapping transfers, several faults
per side, block ids colliding within a source, transfer ids reused by other requests, late events
minutes after the decision, and times that land exactly on the audit's boundaries.

A history is a pure function of a seed and a `Shape` (Hypothesis draws both), so a failing example
is replayed from two numbers. Times are multiples of 1/64 s: sums and differences of them are exact
in floating point, so "exactly at a deadline" means exactly, whichever way a comparison is written.
Events are ordered as a merged log is (by time; ties in a drawn order) and each source's seqs are
gapless from 1 in that order, as a `Ledger` assigns them. Times never step back: the fold's orphan
audit walks never-mapped sides in first-sight order and stops at the first one not yet due.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from kvledger.ledger.events import Ack, Event, Expire, Fail, Map, ReqId, Schedule, Seal, TransferId
from kvledger.ledger.limits import LAYERS_MAX, RANKS_MAX

TICK = 1 / 64
"""Every time is a multiple of this (exact in binary floating point)."""

TRANSFER_TIMEOUT_S = 30.0
CLOCK_SKEW_S = 0.5
"""The audit's defaults; boundaries are placed on them."""

LAYER_STEPS: tuple[tuple[int, ...], ...] = ((0, 1), (2, 3), (4, 5), (6, 7))
"""Every WRITE transfer writes these tuples: the fold's layer-mask cache is warm after the first one,
so its inline fast paths run for the rest."""

FAULTS = (
    "transient", "terminal", "expire", "expire_at_deadline", "dup", "drop", "early", "swap", "late",
    "late_burst", "same_map", "other_map", "unfit", "layer_range", "rank_range", "reseal", "deferred",
    "early_unscheduled",
)  # fmt: skip
"""Per-side faults; each side draws several (with repeats)."""


@dataclass(frozen=True)
class Shape:
    transfers: int = 16
    span_s: float = 40.0
    """Log seconds over which transfers start."""
    faults_per_side: float = 2.0
    """Mean faults per side (geometric: several on one side are as likely as in life, or more)."""
    reuse_rate: float = 0.15
    """Chance a transfer reuses an earlier transfer's id (both sides, new request ids)."""
    orphan_rate: float = 0.05
    """Chance a side's map never comes (its other events are orphans; some expire, some are mapped late)."""
    premature_rate: float = 0.1
    """Chance a READ transfer's producer expires with the consumer's read finishing near the skew boundary."""
    overfull_rate: float = 0.1
    """Chance a consumer holds one block more than the producer sends (failed at its map)."""
    late_gap_s: float = 30.0
    """Late events come up to this long after the side's last event (past a retention window if large)."""
    block_pool: int = 10
    """Block ids per source are drawn from range(block_pool): concurrent sides collide."""
    producers: tuple[str, ...] = ("prefill-0/tp0", "prefill-1/tp0")
    consumers: tuple[str, ...] = ("decode-0/tp0",)


def _t(x: float) -> float:
    """`x` rounded down to the tick grid."""
    return int(x / TICK) * TICK


@dataclass
class _Item:
    kind: str
    fields: dict[str, Any]
    ts: float = 0.0
    fixed: bool = False
    """A time set on purpose (a deadline, a skew boundary): kept even if it breaks the side's order."""


class _Side:
    """One side's intended events (kind, fields), then its faults, then times."""

    def __init__(self, rng: random.Random, source: str, tid: str, start: float) -> None:
        self.rng, self.source, self.tid, self.start = rng, source, tid, start
        self.items: list[_Item] = []

    def add(self, kind: str, **fields: Any) -> _Item:
        item = _Item(kind, fields)
        self.items.append(item)
        return item


def _steps(rng: random.Random, n: int) -> list[float]:
    return [_t(rng.choice((0.0, TICK, 0.25, 0.5, 1.0, 2.0, rng.uniform(0, 5)))) for _ in range(n)]


def history(seed: int, shape: Shape = Shape()) -> list[Event]:
    """A merged, seq-numbered event history (see the module docstring)."""
    rng = random.Random(seed)
    sides: list[_Side] = []
    used: list[tuple[str, str, str]] = []
    for i in range(shape.transfers):
        start = _t(rng.uniform(0.0, shape.span_s))
        if used and rng.random() < shape.reuse_rate:
            tid, producer, consumer = rng.choice(used)
        else:
            tid, producer, consumer = f"tx-{i}", rng.choice(shape.producers), rng.choice(shape.consumers)
            used.append((tid, producer, consumer))
        sides.extend(_transfer(rng, shape, i, tid, producer, consumer, start))
    return _merge(rng, sides)


def _blocks(rng: random.Random, shape: Shape, n: int) -> tuple[int, ...]:
    return tuple(rng.sample(range(shape.block_pool), min(n, shape.block_pool)))  # distinct within one map


def _transfer(
    rng: random.Random, shape: Shape, i: int, tid: str, producer: str, consumer: str, start: float
) -> list[_Side]:
    mode = rng.choice(("read", "write"))
    p, c = _Side(rng, producer, tid, start), _Side(rng, consumer, tid, _t(start + rng.choice((0.0, TICK, 0.5))))
    n = rng.randint(1, 3)
    p_blocks = _blocks(rng, shape, n)
    c_blocks = _blocks(rng, shape, n + 1 if rng.random() < shape.overfull_rate else rng.randint(1, n))
    ranks = rng.randint(1, 3) if mode == "read" else 1
    defer, transfer = _t(rng.uniform(2.0, 90.0)), _t(rng.uniform(2.0, 60.0))
    p.add("map", tid=tid, req=f"p-{i}", role="producer", mode=mode, blocks=p_blocks, acks=ranks,
          deadline=_t(start + defer))  # fmt: skip
    c.add("map", tid=tid, req=f"c-{i}", role="consumer", mode=mode, blocks=c_blocks, remote=p_blocks,
          deadline=_t(c.start + transfer))  # fmt: skip
    if mode == "write":
        steps = LAYER_STEPS[: rng.randint(1, len(LAYER_STEPS))]
        seal_at = rng.randrange(len(steps) + 1)
        coalesced = rng.random() < 0.2  # one schedule for all steps: the acks' tuples are new to the fold
        if coalesced:
            p.add("schedule", tid=tid, layers=sum(steps, ()), op="write")
        for j, layers in enumerate(steps):
            if j == seal_at:
                p.add("seal", tid=tid, expected=2 * len(steps))
            if not coalesced:
                p.add("schedule", tid=tid, layers=layers, op="write")
            p.add("ack", tid=tid, what="write", layers=layers)
        if seal_at == len(steps):
            p.add("seal", tid=tid, expected=2 * len(steps))
        c.add("ack", tid=tid, what="recv")
        if rng.random() < 0.1:
            p.add("ack", tid=tid, what="release")  # the consumer aborted: frees a WRITE producer too
    else:
        if rng.random() < 0.25:  # a layered read, sealed
            steps = LAYER_STEPS[: rng.randint(1, len(LAYER_STEPS))]
            for layers in steps:
                c.add("schedule", tid=tid, layers=layers, op="read")
                c.add("ack", tid=tid, what="read", layers=layers)
            c.add("seal", tid=tid, expected=2 * len(steps))
        else:
            c.add("schedule", tid=tid, op="read")
            c.add("ack", tid=tid, what=rng.choice(("read", "read", "recv")))
        for rank in rng.sample(range(ranks), ranks):
            p.add("ack", tid=tid, what="release", rank=rank)
        if rng.random() < shape.premature_rate:
            return _premature(rng, p, c, start)
    for side in (p, c):
        while rng.random() < shape.faults_per_side / (1.0 + shape.faults_per_side):
            _fault(rng, shape, side, rng.choice(FAULTS))
        if rng.random() < shape.orphan_rate:
            _orphan(rng, side)
        _times(rng, side)
    return [p, c]


def _premature(rng: random.Random, p: _Side, c: _Side, start: float) -> list[_Side]:
    """The producer is expired at its deadline; the consumer's read finishes just before, exactly at,
    or just after the clock-skew allowance past it."""
    deadline = p.items[0].fields["deadline"]
    p.items[1:] = []
    p.add("expire", tid=p.tid, deadline="defer").fixed = True
    for item in c.items:
        if item.kind == "ack":
            item.fixed = True
            item.ts = deadline + CLOCK_SKEW_S + rng.choice((-TICK, 0.0, 0.0, TICK, 3.0))
    _times(rng, p)
    p.items[-1].ts = deadline
    _times(rng, c)
    return [p, c]


def _fault(rng: random.Random, shape: Shape, side: _Side, fault: str) -> None:
    items, tid = side.items, side.tid
    m = items[0].fields if items and items[0].kind == "map" else None
    pos = rng.randint(1, len(items)) if items else 0
    if fault == "transient":
        items.insert(pos, _Item("fail", dict(tid=tid, reason="SQ full", retryable=True)))
        items.insert(pos + 1, _Item("schedule", dict(tid=tid, op="read", attempt=1)))
    elif fault == "terminal":
        items.insert(pos, _Item("fail", dict(tid=tid, reason=rng.choice(("boom", "RDMA write failed")))))
    elif fault == "expire":
        items.insert(pos, _Item("expire", dict(tid=tid, deadline=rng.choice(("defer", "transfer")))))
    elif fault == "expire_at_deadline" and m is not None:
        item = _Item("expire", dict(tid=tid, deadline="transfer"), ts=m["deadline"], fixed=True)
        items.append(item)
    elif fault == "dup" and items:
        original = rng.choice(items)
        items.insert(rng.randint(items.index(original) + 1, len(items)), _Item(original.kind, dict(original.fields)))
    elif fault == "drop" and len(items) > 1:
        items.pop(rng.randrange(1, len(items)))
    elif fault == "early" and len(items) > 1:
        items.insert(0, items.pop(rng.randrange(1, len(items))))  # before the map
    elif fault == "swap" and len(items) > 1:
        j = rng.randrange(len(items) - 1)
        items[j], items[j + 1] = items[j + 1], items[j]
    elif fault in ("late", "late_burst") and items:
        gap = _t(rng.uniform(0.0, shape.late_gap_s))
        for _ in range(1 if fault == "late" else rng.randint(2, 40)):
            original = rng.choice(items)
            items.append(_Item(original.kind, dict(original.fields), ts=gap))
    elif fault in ("same_map", "other_map") and m is not None:
        again = dict(m)
        if fault == "other_map":
            again["req"] = f"{m['req']}-again-{rng.randrange(1000)}"
            again["blocks"] = _blocks(rng, shape, rng.randint(1, 3))
        gap = _t(rng.choice((0.0, 1.0, shape.late_gap_s * rng.random())))
        items.insert(pos, _Item("map", again, ts=gap))
    elif fault == "unfit" and m is not None:
        what = rng.choice(("read", "write", "recv", "release"))
        layers = rng.choice((None, rng.choice(LAYER_STEPS)))
        items.insert(pos, _Item("ack", dict(tid=tid, what=what, layers=layers)))
    elif fault == "layer_range":
        layers = rng.choice(((LAYERS_MAX,), (-1,), (0, LAYERS_MAX + 3)))
        kind = rng.choice(("schedule", "ack"))
        fields: dict[str, Any] = dict(tid=tid, layers=layers)
        if kind == "schedule":
            fields["op"] = "write"
        else:
            fields["what"] = "write"
        items.insert(pos, _Item(kind, fields))
    elif fault == "rank_range":
        items.insert(pos, _Item("ack", dict(tid=tid, what="release", rank=rng.choice((RANKS_MAX, -1)))))
    elif fault == "reseal":
        items.insert(pos, _Item("seal", dict(tid=tid, expected=rng.randint(0, 9))))
    elif fault == "deferred":
        items.insert(pos, _Item("schedule", dict(tid=tid, op="write", layers=rng.choice(LAYER_STEPS), deferred=True)))
    elif fault == "early_unscheduled":
        items.insert(pos, _Item("ack", dict(tid=tid, what="write", layers=rng.choice(LAYER_STEPS))))


def _orphan(rng: random.Random, side: _Side) -> None:
    """The side's map does not come with the rest: never, after an expire of its orphans, or last."""
    the_map = side.items.pop(0)
    if not side.items:
        side.items.append(_Item("ack", dict(tid=side.tid, what="release")))
    fate = rng.choice(("never", "expired", "expired_then_mapped", "mapped_last"))
    if fate in ("expired", "expired_then_mapped"):
        side.items.append(_Item("expire", dict(tid=side.tid, deadline="transfer"), ts=TRANSFER_TIMEOUT_S))
    if fate in ("expired_then_mapped", "mapped_last"):
        side.items.append(the_map)


def _times(rng: random.Random, side: _Side) -> None:
    """Times along the side's order from its start; an item's preset `ts` is a gap before it (or, if
    `fixed`, its time)."""
    now = side.start
    for item, step in zip(side.items, _steps(rng, len(side.items)), strict=True):
        if item.fixed:
            continue
        now = _t(now + step + item.ts)
        item.ts = now


def _merge(rng: random.Random, sides: list[_Side]) -> list[Event]:
    timed = [(item.ts, rng.random(), side.source, item) for side in sides for item in side.items]
    timed.sort(key=lambda x: (x[0], x[1]))
    seqs: dict[str, int] = {}
    out: list[Event] = []
    for ts, _, source, item in timed:
        seq = seqs[source] = seqs.get(source, 0) + 1
        out.append(_event(item, source, seq, ts))
    return out


def _event(item: _Item, source: str, seq: int, ts: float) -> Event:
    f = dict(item.fields)
    env: dict[str, Any] = {"seq": seq, "ts": ts, "source": source, "transfer_id": TransferId(f.pop("tid"))}
    if item.kind == "map":
        return Map(
            **env, request_id=ReqId(f["req"]), role=f["role"], mode=f["mode"], block_ids=f["blocks"],
            remote_block_ids=f.get("remote"), acks_expected=f.get("acks", 1), deadline=f["deadline"],
        )  # fmt: skip
    kinds: dict[str, type[Event]] = {"schedule": Schedule, "seal": Seal, "ack": Ack, "fail": Fail, "expire": Expire}
    return kinds[item.kind](**env, **f)  # type: ignore[return-value]


def audit_moments(events: list[Event], rng: random.Random, *, count: int = 6) -> list[float]:
    """Audit times on the boundaries of `events`: map deadlines, event times plus the transfer timeout,
    a little either side of some, the last event's time and long after."""
    if not events:
        return [0.0]
    edges = {e.deadline for e in events if isinstance(e, Map)} | {e.ts + TRANSFER_TIMEOUT_S for e in events}
    picked = rng.sample(sorted(edges), min(count, len(edges)))
    nudged = [x + rng.choice((-TICK, TICK)) for x in rng.sample(picked, len(picked) // 2)]
    last = max(e.ts for e in events)
    return sorted({*picked, *nudged, last, last + 10 * TRANSFER_TIMEOUT_S})
