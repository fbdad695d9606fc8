"""The partition function is stable across processes and spreads ids over every partition."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvledger.ledger.events import Event
from kvledger.ledger.partition import partition_of, partition_of_event, rising_groups
from tests.fuzz.strategies import events


def test_same_partition_in_another_process() -> None:
    ids = [f"tx-{n:08x}" for n in range(200)]
    here = [partition_of(tid, 16) for tid in ids]
    code = "import sys; from kvledger.ledger.partition import partition_of; "
    code += "print([partition_of(t, 16) for t in sys.argv[1:]])"
    there = subprocess.run([sys.executable, "-c", code, *ids], capture_output=True, text=True, check=True)
    assert there.stdout.strip() == str(here)


def test_every_partition_used_and_in_range() -> None:
    seen = {partition_of(f"tx-{n}", 8) for n in range(1000)}
    assert seen == set(range(8))


def test_one_partition_holds_all() -> None:
    assert {partition_of(f"tx-{n}", 1) for n in range(50)} == {0}


def test_zero_partitions_refused() -> None:
    with pytest.raises(ValueError, match="partitions must be at least 1, got 0"):
        partition_of("tx-1", 0)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(events, max_size=30), st.integers(1, 5), st.integers(0, 3))
def test_rising_groups_are_the_batch_by_partition_and_source_or_none(
    batch: list[Event], partitions: int, stored: int
) -> None:
    """A store's append groups a batch with `rising_groups` (compiled); the definition, written plainly."""
    above = {e.source: stored for e in batch}
    last = dict(above)
    rising = True
    expected: dict[tuple[int, str], list[Event]] = {}
    for e in batch:
        rising = rising and e.seq > last[e.source]
        last[e.source] = e.seq
        expected.setdefault((partition_of_event(e, partitions), e.source), []).append(e)
    got = rising_groups(batch, partitions, above)
    assert got == (expected if rising else None)
    assert got is None or list(got) == list(expected)  # groups in the order of their first event
