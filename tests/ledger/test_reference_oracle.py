"""The fold and the audit agree with an independent reference (tests/ledger/reference.py) on unkind
histories (tests/ledger/histories.py): every release, in order, and every finding at moments on the
audit's boundaries. The reference is pinned by hand first, so that it cannot drift with the fold."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from kvledger.ledger.audit import SEVERITY_RANK, audit
from kvledger.ledger.fold import fold_all
from tests.ledger.builders import Side
from tests.ledger.histories import Shape, audit_moments, history
from tests.ledger.reference import Reference, canonical

T = "tx-1"

SHAPES = st.builds(
    Shape,
    transfers=st.integers(1, 24),
    span_s=st.sampled_from([5.0, 40.0, 120.0]),
    faults_per_side=st.sampled_from([0.5, 1.0, 2.0, 4.0]),
    reuse_rate=st.sampled_from([0.0, 0.15, 0.4]),
    orphan_rate=st.sampled_from([0.0, 0.1, 0.3]),
    premature_rate=st.sampled_from([0.0, 0.3]),
    late_gap_s=st.sampled_from([5.0, 30.0, 200.0]),
    block_pool=st.integers(3, 12),
    producers=st.sampled_from([("prefill-0/tp0",), ("prefill-0/tp0", "prefill-1/tp0")]),
    consumers=st.sampled_from([("decode-0/tp0",), ("decode-0/tp0", "decode-1/tp0")]),
)


@settings(
    max_examples=500, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)  # fmt: skip
@given(seed=st.integers(0, 2**32 - 1), shape=SHAPES)
def test_the_fold_and_the_audit_agree_with_the_reference(seed: int, shape: Shape) -> None:
    note(f"events = history({seed}, {shape!r})")
    events = history(seed, shape)
    state, releases = fold_all(events)
    reference = Reference(events)
    assert releases == reference.releases
    assert state.releases_by_cause == {
        c: sum(r.cause == c for r in releases) for c in ("completed", "failed", "expired")
    }
    live = [v for v in reference.verdicts.values() if v.live]
    assert state.blocks_held == sum(len(v.mapped.block_ids) for v in live if v.mapped is not None)
    for source in reference.sources:
        holders = reference.holders(source)
        assert state.held.get(source, set()) == set(holders)
        for block in range(shape.block_pool + 1):
            assert state.claimants(source, block) == holders.get(block, []), (source, block)
    for now in audit_moments(events, random.Random(seed)):
        findings = audit(state, now)
        assert canonical(findings) == canonical(reference.findings(now)), now
        order = [(SEVERITY_RANK[f.severity], f.evidence[0] if f.evidence else 0) for f in findings]
        assert order == sorted(order), "worst first, then oldest evidence"


def _codes(reference: Reference, now: float) -> list[tuple[str, tuple[int, ...]]]:
    return sorted((f.code, f.evidence) for f in reference.findings(now))


def test_the_reference_decides_the_documented_rules() -> None:
    p, c = Side("prefill-0/tp0"), Side("decode-0/tp0")
    events = [
        p.map("r", "p-r", "producer", "read", acks=2),  # p1
        p.ack("r", "release", rank=1),  # p2
        p.ack("r", "release", rank=1),  # p3: a duplicate rank counts once
        p.ack("r", "release", rank=0),  # p4: completes
        p.map("w", "p-w", "producer", "write", blocks=(7,)),  # p5
        p.schedule("w", (0, 1), op="write"),  # p6
        p.ack("w", "write", (0, 1)),  # p7
        p.seal("w", 2),  # p8: completes at the seal
        c.ack("x", "recv"),  # c1: before its map
        c.map("x", "c-x", "consumer", "write", remote=(1, 2, 3)),  # c2: completes at the map
        c.map("big", "c-big", "consumer", "read", blocks=(1, 2), remote=(9,)),  # c3: more than sent: failed
        p.map("r", "p-other", "producer", "read"),  # p9: a used id: refused
        p.ack("w", "write", (0,)),  # p10: late
    ]
    reference = Reference(events)
    assert [(r.transfer_id, r.cause, r.seq) for r in reference.releases] == [
        ("r", "completed", 4),
        ("w", "completed", 8),
        ("x", "completed", 2),
        ("big", "failed", 3),
    ]
    assert _codes(reference, now=p.ts) == [
        ("duplicate", (3,)),
        ("id_reuse", (1, 9)),
        ("late_event", (10,)),
    ]


def test_the_reference_reports_leaks_stuck_sides_orphans_owners_and_premature_releases() -> None:
    p, c = Side("prefill-0/tp0", start_ts=0.0), Side("decode-0/tp0", start_ts=0.0)
    events = [
        p.map("a", "p-a", blocks=(1, 2), deadline=10.0, ts=0.0),
        p.map("b", "p-b", blocks=(2, 3), deadline=100.0, ts=0.0),  # block 2 twice while a lives
        p.ack("o", "release", ts=0.0),  # never mapped
        p.map("e", "p-e", blocks=(9,), deadline=5.0, ts=1.0),
        c.map("e", "c-e", "consumer", "read", blocks=(4,), remote=(9,), ts=1.0),
        p.expire("e", ts=5.0),
        c.ack("e", "read", ts=5.5),  # exactly at the clock skew: not premature
    ]
    reference = Reference(events)
    assert _codes(reference, now=5.0) == [("double_owner", (1, 2))]
    assert _codes(reference, now=30.0) == [("double_owner", (1, 2)), ("leak", (1,)), ("orphan_ack", (3, 3))]
    assert _codes(reference, now=30.125) == [
        ("double_owner", (1, 2)), ("leak", (1,)), ("orphan_ack", (3, 3)), ("stuck", (2, 2)),
    ]  # fmt: skip
    late = Reference([*events[:-1], c.ack("e", "read", ts=5.5 + 1 / 64)])
    assert ("premature_release", (5, 3)) in _codes(late, now=6.0)
