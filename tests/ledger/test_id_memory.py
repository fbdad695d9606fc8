"""The id memory: no false negatives within its horizon, false positives within the documented bound,
the same answers in every process, and a snapshot that round-trips."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ledger.idmemory import IdMemory
from ledger.limits import ID_MEMORY_FALSE_POSITIVE_MAX

SOURCE = "prefill-0/sched"


def test_every_key_added_is_remembered_for_the_whole_horizon() -> None:
    memory = IdMemory(generation_ids=100, generations=4)
    for i in range(400):  # exactly four generations: all still held
        memory.add(SOURCE, f"tx-{i}")
    assert all(memory.contains(SOURCE, f"tx-{i}") for i in range(400))
    memory.add(SOURCE, "tx-400")  # seals the fourth... and the oldest generation goes
    assert len(memory.older) == 3 and memory.count == 1
    forgotten = sum(not memory.contains(SOURCE, f"tx-{i}") for i in range(100))
    assert forgotten > 95  # the oldest generation's keys are new again (a few collide: false positives)
    assert all(memory.contains(SOURCE, f"tx-{i}") for i in range(100, 401))


def test_false_positives_stay_below_the_documented_bound_with_every_generation_full() -> None:
    memory = IdMemory(generation_ids=2048, generations=4)
    for i in range(2048 * 4 - 1):
        memory.add(SOURCE, f"tx-{i}")
    probes = 200_000
    false_positives = sum(memory.contains(SOURCE, f"fresh-{i}") for i in range(probes))
    assert false_positives <= ID_MEMORY_FALSE_POSITIVE_MAX * probes
    # Keys differ by source as well as by transfer id.
    assert not memory.contains("decode-0/sched", "tx-1") or memory.contains(SOURCE, "tx-1")


def test_answers_do_not_depend_on_the_process_hash_seed() -> None:
    """The live connector and an offline replay run in different processes: they must take the same
    false positives, so the memory never uses Python's salted `hash`."""
    script = (
        "from ledger.idmemory import IdMemory\n"
        "m = IdMemory(generation_ids=64, generations=2)\n"
        "[m.add('s', f'tx-{i}') for i in range(100)]\n"
        "print(bytes(m.current).hex(), [i for i in range(20000) if m.contains('s', f'new-{i}')])\n"
    )
    outputs = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
        outputs.add(run.stdout)
    assert len(outputs) == 1


def test_plain_round_trip_and_bad_plain_data() -> None:
    memory = IdMemory(generation_ids=10, generations=3)
    for i in range(25):
        memory.add(SOURCE, f"tx-{i}")
    restored = IdMemory.from_plain(memory.to_plain())
    assert restored.to_plain() == memory.to_plain()
    assert all(restored.contains(SOURCE, f"tx-{i}") for i in range(25))
    generation_ids, generations, hashes, count, added, blooms = memory.to_plain()
    with pytest.raises(ValueError, match="powers of two"):
        IdMemory.from_plain((generation_ids, generations, hashes, count, added, [blooms[0][:-1]]))
    with pytest.raises(ValueError, match="more than"):
        IdMemory.from_plain((generation_ids, 1, hashes, count, added, blooms))
    with pytest.raises(ValueError, match=">= 1"):
        IdMemory(generation_ids=0)
