"""Fuzz the fold: any sequence of well-typed events, with upkeep in between, never raises.

A stateful Hypothesis machine applies arbitrary events (colliding ids, repeated blocks and
layers, numbers past 64 bits, times no clock prints) and the shells' upkeep (forgetting,
compaction) in any order. After every step the audit, the summary and a timeline still run,
and the claims index equals one recomputed from the live sides: what does not fit is
evidence, never an exception and never a block freed twice or kept forever.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvledger.ledger.audit import audit
from kvledger.ledger.events import Event
from kvledger.ledger.fold import LedgerState
from kvledger.ledger.summary import summarize
from kvledger.ledger.timeline import build
from tests.fuzz.strategies import TRANSFER_IDS, events, examples
from tests.ledger.builders import Side


def check_claims_index(state: LedgerState) -> None:
    """`held`, `contested` and `blocks_held` equal what the live sides' maps say, recomputed."""
    holders: dict[tuple[str, int], list[tuple[str, str]]] = {}
    blocks_held = 0
    for key, t in state.live.items():
        blocks_held += len(t.block_ids)
        for block in dict.fromkeys(t.block_ids):
            holders.setdefault((t.source, block), []).append(key)
    assert state.blocks_held == blocks_held
    for source in state.sources:
        assert state.held.get(source, set()) == {b for (s, b) in holders if s == source}, source
    for (source, block), keys in holders.items():
        if len(keys) > 1:
            assert sorted(state.contested[(source, block)]) == sorted(keys), (source, block)
        else:
            assert (source, block) not in state.contested, (source, block)
        assert sorted(state.claimants(source, block)) == sorted(keys)
    assert set(state.contested) <= set(holders)


class FoldMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.state = LedgerState()
        self.seen: list[Event] = []
        self.released: set[tuple[str, str]] = set()

    @rule(event=events)
    def apply(self, event: Event) -> None:
        key = (event.source, event.transfer_id)
        release = self.state.apply(event)
        self.seen.append(event)
        if release is not None:
            assert key not in self.released, f"second release of {key}"
            self.released.add(key)

    @rule(before_ts=st.sampled_from([0.0, 1050.0, 1e12, float("inf")]), keep=st.booleans())
    def forget(self, before_ts: float, keep: bool) -> None:
        self.state.forget_decided(before_ts, keep_evidence=keep)

    @rule(clean_only=st.booleans())
    def compact(self, clean_only: bool) -> None:
        self.state.compact(clean_only=clean_only)

    @rule()
    def expire_everything_due(self) -> None:
        """The connector's clock tick far in the future: every live side and orphan is given up."""
        sides = {source: Side(source, start_ts=2000.0) for source in self.state.sources}
        for t in self.state.due(1e300) + self.state.orphans_due(1e300, 1.0):
            self.state.apply(sides[t.source].expire(t.transfer_id, ts=2000.0))

    @invariant()
    def audit_and_views_still_run(self) -> None:
        for now in (0.0, 1050.0, 1e12):
            findings = audit(self.state, now)
            summarize(self.state, findings)
        build(self.seen[-50:], TRANSFER_IDS[0])

    @invariant()
    def claims_index_is_right(self) -> None:
        check_claims_index(self.state)


FoldMachine.TestCase.settings = settings(
    max_examples=examples(150),
    stateful_step_count=40,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_the_fold_never_raises_on_any_event_sequence = FoldMachine.TestCase


def test_minimal_poison_sequence_is_evidence() -> None:
    """The crash this fuzz target first found: a map naming a block twice, two more claimants, then
    the first one decided (`list.remove(x): x not in list`)."""
    p = Side("p/tp0")
    state = LedgerState()
    for event in (p.map("a", "ra", blocks=(2, 2)), p.map("b", "rb", blocks=(2,)), p.map("c", "rc", blocks=(2,))):
        state.apply(event)
    release = state.apply(p.expire("a"))
    assert release is not None and release.cause == "expired"
    assert sorted(state.claimants("p/tp0", 2)) == [("p/tp0", "b"), ("p/tp0", "c")]
    check_claims_index(state)
    assert state.transfers[("p/tp0", "a")].duplicate_seqs == [1]  # the repeated block is evidence
    assert "duplicate" in {f.code for f in audit(state, p.ts)}
