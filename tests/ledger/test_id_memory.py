"""The id memory: no false negatives within its horizon, false positives within the documented bound,
the same answers in every process, and a snapshot that round-trips."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvledger.ledger import idmemory
from kvledger.ledger.idmemory import IdMemory
from kvledger.ledger.limits import ID_MEMORY_FALSE_POSITIVE_MAX

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
        "from kvledger.ledger.idmemory import IdMemory\n"
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


def _reference_hash(source: str, transfer_id: str) -> int:
    """FNV-1a (64-bit) over the key's code points and a 0 between, then MurmurHash3's fmix64: written
    out here from their published definitions, apart from ledger/idmemory.py."""
    h = 0xCBF29CE484222325
    for point in [*map(ord, source), 0, *map(ord, transfer_id)]:
        h = ((h ^ point) * 0x100000001B3) % 2**64
    for multiplier in (0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53):
        h = ((h ^ (h >> 33)) * multiplier) % 2**64
    return h ^ (h >> 33)


@pytest.mark.parametrize(
    "source, transfer_id",
    [("prefill-0/sched", "tx-1"), ("", ""), ("d/é", "ü€𝄞-transfer"), ("s" * 300, "x" * 700), ("a\x00", "b")],
)
def test_key_hash_is_fnv1a_then_fmix64_in_either_build(source: str, transfer_id: str) -> None:
    """The compiled hash wraps at 2**64 in C, the interpreted one masks Python ints: both must be this
    one function, or a replay would not take the connector's false positives (CI runs both builds)."""
    assert idmemory.key_hash(source, transfer_id) == _reference_hash(source, transfer_id)
    assert idmemory.step_of(_reference_hash(source, transfer_id)) % 2 == 1
