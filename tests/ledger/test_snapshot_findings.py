"""A snapshot round trip keeps every finding (issue 36, item 6): a fold saved and loaded mid-history, then fed
the rest of it, audits exactly as the fold that never stopped, at every boundary moment. Findings that live in
the fold's state (`forged_message` names the recent `drop` events: 3 before a restart, 0 after, once) are
part of what is saved. Histories are `tests.ledger.histories`' unkind ones with refused control messages
(`drop`) among them."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvledger.ledger.audit import audit
from kvledger.ledger.events import Drop, Event, TransferId
from kvledger.ledger.fold import LedgerState, fold_all
from kvledger.ledger.store import snapshot
from tests.ledger.histories import Shape, audit_moments, history

GATE = "decode-0/tp1"
"""The source whose channel refused the forged messages (its seqs are its own, gapless from 1)."""


def _with_drops(events: list[Event], rng: random.Random, count: int) -> list[Event]:
    """`events` with `count` drops of forged messages among them, naming the history's transfer ids, at the
    times of events already there (merged in time order, as a store's merge of sources is)."""
    if not events or not count:
        return events
    picked = sorted(rng.sample(range(len(events)), min(count, len(events))))
    out: list[Event] = []
    seq = 0
    for i, e in enumerate(events):
        out.append(e)
        if picked and i == picked[0]:
            picked.pop(0)
            seq += 1
            reason = rng.choice(("bad_mac", "sender_not_allowed", "wrong_receiver"))
            out.append(Drop(seq=seq, ts=e.ts, source=GATE, transfer_id=TransferId(e.transfer_id),
                            message="release", sender="127.0.0.1", reason=reason))  # fmt: skip
    return out


def _round_trip(state: LedgerState) -> LedgerState:
    return snapshot.decode(snapshot.encode(state))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), drops=st.integers(0, 6), split=st.floats(0.0, 1.0))
def test_findings_read_the_same_after_a_snapshot_round_trip(seed: int, drops: int, split: float) -> None:
    rng = random.Random(seed)
    events = _with_drops(history(seed, Shape(transfers=8)), rng, drops)
    cut = round(split * len(events))
    uninterrupted, releases = fold_all(events)
    saved, before = fold_all(events[:cut])
    restored = _round_trip(saved)
    for now in audit_moments(events[:cut], rng):
        assert audit(restored, now) == audit(saved, now), f"seed {seed}: findings changed at save/load"
    _, after = fold_all(events[cut:], restored)
    assert before + after == releases
    for now in audit_moments(events, rng):
        assert audit(restored, now) == audit(uninterrupted, now), f"seed {seed}: findings changed after restart"


def test_forged_message_findings_survive_a_restart_from_a_snapshot() -> None:
    events = _with_drops(history(7, Shape(transfers=4)), random.Random(7), 3)
    state, _ = fold_all(events)
    now = max(e.ts for e in events)
    forged = [f for f in audit(state, now) if f.code == "forged_message"]
    assert len(forged) == 3
    assert [f for f in audit(_round_trip(state), now) if f.code == "forged_message"] == forged
