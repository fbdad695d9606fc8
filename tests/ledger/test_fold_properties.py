"""Property tests: random event streams with reordering, duplication, loss and faults.

An independent, deliberately naive model (`Oracle`) re-derives from the raw
events whether and when each side's release is due; the fold must agree with it.
"""

from __future__ import annotations

import random
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvledger.ledger.audit import audit
from kvledger.ledger.decisions import Release
from kvledger.ledger.events import Ack, Event, Expire, Fail, Map, Schedule, Seal
from kvledger.ledger.fold import LedgerState, fold_all
from tests.ledger.builders import Side

SOURCES = ("prefill-0/tp0", "decode-0/tp0")
TIDS = ("tx-a", "tx-b", "tx-c")


@st.composite
def scripts(draw: st.DrawFn) -> list[Event]:
    """Plausible per-transfer scripts, then shuffled, duplicated and thinned."""
    sides = {s: Side(s) for s in SOURCES}
    intents: list[tuple[str, str, dict[str, Any]]] = []
    for i, tid in enumerate(TIDS):
        mode = draw(st.sampled_from(["read", "write"]))
        ranks = draw(st.integers(1, 4))
        layers = draw(st.integers(1, 4))
        base = 10 * i
        acks = ranks if mode == "read" else 1
        producer = dict(tid=tid, req=f"p-{i}", role="producer", mode=mode, blocks=(base, base + 1), acks=acks)
        intents.append((SOURCES[0], "map", producer))
        remote = tuple(range(draw(st.sampled_from([2, 2, 2, 1]))))
        consumer = dict(tid=tid, req=f"c-{i}", role="consumer", mode=mode, blocks=(base + 5, base + 6), remote=remote)
        intents.append((SOURCES[1], "map", consumer))
        if mode == "write":
            for layer in range(layers):
                intents.append((SOURCES[0], "schedule", dict(tid=tid, layers=(layer,), op="write")))
                intents.append((SOURCES[0], "ack", dict(tid=tid, what="write", layers=(layer,))))
            intents.append((SOURCES[0], "seal", dict(tid=tid, expected=layers)))
            intents.append((SOURCES[1], "ack", dict(tid=tid, what="recv")))
        else:
            intents.append((SOURCES[1], "schedule", dict(tid=tid)))
            intents.append((SOURCES[1], "ack", dict(tid=tid, what="read")))
            for rank in range(ranks):
                intents.append((SOURCES[0], "ack", dict(tid=tid, what="release", rank=rank)))
        for source in SOURCES:
            fault = draw(st.sampled_from(["none", "none", "transient", "terminal", "expire"]))
            if fault == "transient":
                intents.append((source, "fail", dict(tid=tid, reason="SQ full", retryable=True)))
            elif fault == "terminal":
                intents.append((source, "fail", dict(tid=tid, reason="boom")))
            elif fault == "expire":
                intents.append((source, "expire", dict(tid=tid)))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = random.Random(seed)
    ops = draw(st.lists(st.sampled_from(["swap", "dup", "drop"]), max_size=12))
    for op in ops:
        if not intents:
            break
        i = rng.randrange(len(intents))
        if op == "swap":
            j = rng.randrange(len(intents))
            intents[i], intents[j] = intents[j], intents[i]
        elif op == "dup":
            intents.insert(rng.randrange(len(intents) + 1), intents[i])
        else:
            intents.pop(i)
    events: list[Event] = []
    for source, kind, fields in intents:
        events.append(getattr(sides[source], kind)(**fields))
    return events


class Oracle:
    """The release rule of DESIGN.md, recomputed from scratch over each side's event prefix."""

    def __init__(self) -> None:
        self.events: dict[tuple[str, str], list[Event]] = {}

    def feed(self, event: Event) -> None:
        self.events.setdefault((event.source, event.transfer_id), []).append(event)

    def due(self, key: tuple[str, str]) -> str | None:
        evs = self.events.get(key, [])
        maps = [e for e in evs if isinstance(e, Map)]
        if not maps:
            return None
        m = maps[0]
        if m.role == "consumer" and m.remote_block_ids is not None and len(m.block_ids) > len(m.remote_block_ids):
            return "failed"
        if any(isinstance(e, Fail) and not e.retryable for e in evs):
            return "failed"
        if any(isinstance(e, Expire) for e in evs):
            return "expired"
        acks = [e for e in evs if isinstance(e, Ack)]
        scheduled = {layer for e in evs if isinstance(e, Schedule) and e.layers for layer in e.layers}
        seals = [e.expected for e in evs if isinstance(e, Seal)]
        written = {layer for a in acks if a.what == "write" and a.layers for layer in a.layers} & scheduled
        releases = {a.rank for a in acks if a.what == "release"}
        if m.role == "producer":
            if m.mode == "read":
                return "completed" if len(releases) >= m.acks_expected else None
            if (seals and len(written) >= seals[-1]) or len(releases) >= m.acks_expected:
                return "completed"
            return None
        if any(a.what == "recv" for a in acks):
            return "completed"
        if m.mode == "read" and any(a.what == "read" and a.layers is None for a in acks):
            return "completed"
        return None


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scripts())
def test_fold_agrees_with_the_oracle_and_releases_at_most_once(events: list[Event]) -> None:
    state = LedgerState()
    oracle = Oracle()
    released: dict[tuple[str, str], Release] = {}
    for event in events:
        key = (event.source, event.transfer_id)
        already = key in released
        oracle.feed(event)
        release = state.apply(event)
        if release is not None:
            assert not already, f"second release for {key}"
            released[key] = release
            # No release without evidence: the oracle sees a reason at exactly this event.
            assert oracle.due(key) == release.cause, (key, release)
        elif not already:
            assert oracle.due(key) is None, f"{key}: evidence for {oracle.due(key)} but no release"


@settings(max_examples=150, deadline=None)
@given(scripts())
def test_refolding_gives_identical_state_and_decisions(events: list[Event]) -> None:
    first, releases_a = fold_all(events)
    second, releases_b = fold_all(list(events))
    assert releases_a == releases_b
    assert {k: t.snapshot() for k, t in first.transfers.items()} == {
        k: t.snapshot() for k, t in second.transfers.items()
    }
    assert first.blocks_held == second.blocks_held
    assert audit(first, now=2000.0) == audit(second, now=2000.0)


@settings(max_examples=150, deadline=None)
@given(scripts())
def test_nothing_is_held_once_every_deadline_is_expired(events: list[Event]) -> None:
    state, _ = fold_all(events)
    horizon = max(t.deadline or 0.0 for t in state.transfers.values()) + 1.0
    sides = {s: Side(s, start_ts=horizon) for s in SOURCES}
    for t in state.due(horizon):
        assert state.apply(sides[t.source].expire(t.transfer_id, ts=horizon)) is not None
    for t in state.orphans_due(horizon + 100.0, 30.0):
        state.apply(sides[t.source].expire(t.transfer_id, "transfer", ts=horizon))
    assert state.blocks_held == 0
    assert not state.live and not state.unmapped
    assert all(not blocks for blocks in state.held.values()) and not state.contested
    assert [f for f in audit(state, horizon + 100.0) if f.code in ("leak", "stuck", "double_owner")] == []


@settings(max_examples=150, deadline=None)
@given(scripts())
def test_audit_never_reports_a_cleanly_released_transfer(events: list[Event]) -> None:
    state, releases = fold_all(events)
    clean = {
        (r.source, r.transfer_id)
        for r in releases
        if r.cause == "completed" and not state.transfers[(r.source, r.transfer_id)].has_anomaly
    }
    for now in (1000.0, 1100.0, 5000.0):
        for finding in audit(state, now):
            if finding.code == "premature_release":
                continue  # names the producer, whose release was by expire: never clean
            assert (finding.source, finding.transfer_id) not in clean, finding
