"""The partition function is stable across processes and spreads ids over every partition."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvledger.ledger.partition import partition_of


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
