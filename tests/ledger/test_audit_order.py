"""The audit's order is total (`kvledger.ledger.audit.finding_order`): findings gathered from a log's partitions
sort into exactly one fold's order, so two findings that differ only in their request or their blocks still
have one order between them, whichever came first."""

from __future__ import annotations

from itertools import permutations

from kvledger.ledger.audit import finding_of, finding_order
from kvledger.ledger.events import ReqId, TransferId

P = "prefill-0/tp0"
T = TransferId("tx-1")
DETAIL = "duplicate ack, schedule, seal or map"


def test_findings_that_differ_only_in_request_or_blocks_have_one_order() -> None:
    unnamed = finding_of("duplicate", P, T, None, (1,), (3,), DETAIL)
    named = finding_of("duplicate", P, T, ReqId("r-1"), (1,), (3,), DETAIL)
    other_blocks = finding_of("duplicate", P, T, ReqId("r-1"), (2,), (3,), DETAIL)
    later_request = finding_of("duplicate", P, T, ReqId("r-2"), (1,), (3,), DETAIL)
    expected = [unnamed, named, other_blocks, later_request]
    for found in permutations(expected):
        assert sorted(found, key=finding_order) == expected
