"""Hybrid Mamba requests in the storm: each request holds a Mamba state block (its own KV cache group, from the
same pool) beside its attention blocks. Leaks, double frees and premature releases of the state are caught as
those of KV blocks are: the pools, the checksums (the state's bytes are checked like the KV's) and the audit."""

from __future__ import annotations

import dataclasses

import pytest

from kvledger.connector.sim.check import evaluate
from kvledger.connector.sim.config import StormConfig
from kvledger.connector.sim.driver import Storm
from kvledger.connector.sim.integrity import MAMBA_SUFFIX, checksums
from kvledger.ledger.events import Mode, block_groups_of

CONFIG = StormConfig(seed=7, mode="read", requests=200, concurrency=48, mamba_layers=2, fault_rate=0.05)


@pytest.mark.parametrize("mode", ["read", "write"])
def test_a_hybrid_storm_under_faults_holds_nothing_and_moves_the_state(mode: Mode) -> None:
    # WRITE: the forward saves the attention layers only, as vLLM's does; the state goes from wait_for_save.
    storm = Storm(dataclasses.replace(CONFIG, mode=mode))
    result = evaluate(storm, storm.run())
    assert result.ok, result.problems
    assert result.leaked_blocks == 0 and result.double_releases == 0 and result.premature_releases == 0
    assert result.integrity_checked > 0 and result.integrity_failures == 0
    # Every consumer map names its attention blocks and its one state block, as one transfer.
    maps = [t.map_event for t in storm.consumer.scheduler.state.transfers.values() if t.map_event is not None]
    loaded = [m for m in maps if m.block_ids]
    assert loaded and all(m.block_groups == (CONFIG.blocks_per_request, 1) for m in loaded)
    for m in loaded:
        assert len(block_groups_of(m.block_ids, m.block_groups)[1]) == 1
    # The producer workers' maps too: in WRITE they are what each layer writes from, its own group's blocks.
    produced = [t.map_event for t in storm.producer.worker.state.transfers.values() if t.map_event is not None]
    assert any(m.block_ids for m in produced)
    assert all(m.block_groups == (CONFIG.blocks_per_request, 1) for m in produced if m.block_ids)


def test_the_checksums_cover_the_mamba_state() -> None:
    storm = Storm(dataclasses.replace(CONFIG, requests=1, concurrency=1))
    caches = storm.producer.caches
    assert sum(name.endswith(MAMBA_SUFFIX) for name in caches) == 2
    before = checksums(caches, (3, 4, 5), state_blocks=1)
    caches["layers.2.mamba"][5] += 1.0  # the state block of a Mamba layer
    assert checksums(caches, (3, 4, 5), state_blocks=1) != before
    after_state = checksums(caches, (3, 4, 5), state_blocks=1)
    caches["layers.2.mamba"][3] += 1.0  # an attention block's page of a Mamba layer: never moved, never checked
    assert checksums(caches, (3, 4, 5), state_blocks=1) == after_state


class FreesStateAtRequestFinished(Storm):
    """A broken engine that frees each producer request's Mamba state block as soon as the request finishes."""

    def _request_finished(self, round_number: int, now: float) -> None:
        finishing = list(self._finishing)
        super()._request_finished(round_number, now)
        for request in finishing:
            self.producer.pool.free(request.producer.blocks[-1:], request.owner)


def test_a_state_block_freed_before_the_read_is_caught() -> None:
    storm = FreesStateAtRequestFinished(dataclasses.replace(CONFIG, faults=frozenset()))
    result = evaluate(storm, storm.run())
    assert result.integrity_failures > 0  # another prefill's state overwrote it before the consumer read
    assert result.double_releases > 0  # and the ledger's one release freed it a second time
    assert not result.ok


@pytest.mark.parametrize("mode", ["read", "write"])
def test_hybrid_requests_run_in_both_modes_and_a_negative_count_is_refused(mode: Mode) -> None:
    assert StormConfig(mode=mode, mamba_layers=1).block_groups == (StormConfig().blocks_per_request, 1)
    with pytest.raises(ValueError, match="mamba_layers must be >= 0, got -1"):
        StormConfig(mode=mode, mamba_layers=-1)
