"""The collector kept out of the fold's grown containers: what it untracks holds only atomic values, keeps
all it held, and a dict that tracks itself again on an insert is untracked again by the next call."""

from __future__ import annotations

import gc
from collections import deque

from kvledger.ledger.collector import collector_paused, untrack
from kvledger.ledger.fold import fold_all
from kvledger.ledger.synth import SynthConfig, generate

CFG = SynthConfig(transfers=400, concurrency=64, layers=8, layers_per_step=4, fault_rate=0.1)


def _fresh_key(i: int) -> tuple[str, str]:
    return ("prefill-0/tp0", f"tx-{i}")  # built at run time: a new tuple, tracked until a collection looks


def test_untrack_takes_each_container_out_of_the_collector_and_keeps_all_it_holds() -> None:
    keys = {_fresh_key(i): float(i) for i in range(100)}
    blocks, heap, queue = set(range(100)), [(float(i), i, "s", f"t{i}") for i in range(100)], deque(keys)
    expected = (dict(keys), set(blocks), list(heap), list(queue))
    assert all(map(gc.is_tracked, (keys, blocks, heap, queue)))
    untrack([keys, blocks, heap, queue])
    assert not any(map(gc.is_tracked, (keys, blocks, heap, queue)))
    gc.collect()  # nothing it held is freed: an untracked container's references keep them as any other
    assert (keys, blocks, heap, list(queue)) == expected


def test_a_dict_is_tracked_again_by_a_fresh_key_and_untracked_again_by_the_next_call() -> None:
    """Why the service untracks after every batch, not once (kvledger.api.live)."""
    held = {_fresh_key(0): 0}
    untrack([held])
    held[_fresh_key(1)] = 1
    assert gc.is_tracked(held)
    untrack([held])
    assert not gc.is_tracked(held)


def test_what_a_fold_grows_holds_only_values_no_cycle_can_pass_through() -> None:
    """What makes untracking `grown_containers` safe: once the collector has looked at them (a fresh tuple
    of atomic values is tracked until then), nothing they hold is tracked, so none can be in a cycle."""
    with collector_paused():
        state, _ = fold_all(generate(CFG, seed=3))
    gc.collect()
    containers = state.grown_containers()
    assert len(containers) > 5 and any(len(c) for c in containers)  # type: ignore[arg-type]
    for container in containers:
        held = [*container, *container.values()] if isinstance(container, dict) else list(container)  # type: ignore[call-overload]
        tracked = [part for part in held if gc.is_tracked(part)]
        assert tracked == [], (type(container).__name__, tracked[:3])
