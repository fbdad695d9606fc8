"""The exact id memory: every id added is remembered, no other id ever is, and a snapshot keeps it."""

from __future__ import annotations

from ledger.events import TransferId
from ledger.idmemory import IdMemory


def test_every_id_added_is_remembered_and_no_other_is() -> None:
    memory = IdMemory()
    for i in range(20_000):
        memory.add("prefill-0/tp0", TransferId(f"tx-{i:08x}"))
    assert memory.added == 20_000
    assert all(memory.contains("prefill-0/tp0", TransferId(f"tx-{i:08x}")) for i in range(20_000))
    # Not a Bloom filter: 100,000 ids never added, none taken for one that was (the Bloom took some).
    assert not any(memory.contains("prefill-0/tp0", TransferId(f"tx-{i:08x}")) for i in range(20_000, 120_000))
    assert not memory.contains("decode-0/tp0", TransferId("tx-00000001"))  # per source


def test_adding_an_id_twice_counts_it_once_and_plain_data_round_trips() -> None:
    memory = IdMemory()
    for source, tid in [("a", "x"), ("a", "y"), ("b", "x"), ("a", "x")]:
        memory.add(source, TransferId(tid))
    assert memory.added == 3
    again = IdMemory.from_plain(memory.to_plain())
    assert again.to_plain() == memory.to_plain() == [("a", ["x", "y"]), ("b", ["x"])]
    assert again.added == 3 and again.contains("b", TransferId("x")) and not again.contains("b", TransferId("y"))
