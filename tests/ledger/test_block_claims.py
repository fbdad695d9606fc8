"""A map that names one block twice (ledger/indexes.py, `_claim_blocks`): the repeat is duplicate evidence
on the side, the block is claimed once and let go of once, whether the source held nothing before (its
first map) or another live side holds one of the map's blocks too (a double owner besides)."""

from __future__ import annotations

from kvledger.ledger.audit import audit
from kvledger.ledger.decisions import Key
from kvledger.ledger.events import TransferId
from kvledger.ledger.fold import LedgerState
from tests.ledger.builders import Side

P = "prefill-0/tp0"


def _key(tid: str) -> Key:
    return (P, TransferId(tid))


def test_a_block_named_twice_in_a_sources_first_map_is_duplicate_evidence_and_claimed_once() -> None:
    p = Side(P, start_ts=0.0)
    state = LedgerState()
    assert state.apply(p.map("tx-a", "r-a", blocks=(5, 5, 6))) is None
    (duplicate,) = audit(state, 1.0)
    assert duplicate.code == "duplicate" and duplicate.evidence == (1,) and duplicate.transfer_id == "tx-a"
    assert state.claimants(P, 5) == [_key("tx-a")]
    release = state.apply(p.ack("tx-a", "release"))
    assert release is not None and release.cause == "completed"
    assert state.claimants(P, 5) == [] and state.claimants(P, 6) == [] and state.blocks_held == 0


def test_a_block_named_twice_beside_one_another_side_holds_is_duplicate_and_double_owner_evidence() -> None:
    p = Side(P, start_ts=0.0)
    state = LedgerState()
    state.apply(p.map("tx-a", "r-a", blocks=(1,)))
    assert state.apply(p.map("tx-b", "r-b", blocks=(1, 7, 7))) is None
    found = {(f.code, str(f.transfer_id)): f for f in audit(state, 1.0)}
    assert set(found) == {("duplicate", "tx-b"), ("double_owner", "tx-b")}
    assert found[("duplicate", "tx-b")].evidence == (2,)
    assert found[("double_owner", "tx-b")].evidence == (1, 2)  # the holder's map, then this one
    assert state.claimants(P, 1) == [_key("tx-a"), _key("tx-b")]
    assert state.claimants(P, 7) == [_key("tx-b")]
    state.apply(p.ack("tx-b", "release"))
    assert state.claimants(P, 1) == [_key("tx-a")] and state.claimants(P, 7) == []
    state.apply(p.ack("tx-a", "release"))
    assert state.claimants(P, 1) == [] and state.blocks_held == 0
