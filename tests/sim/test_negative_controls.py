"""The simulator catches a broken connector: a too-short defer timeout, and blocks freed before the read."""

from __future__ import annotations

import dataclasses

from kvledger.connector.sim.check import evaluate
from kvledger.connector.sim.config import StormConfig
from kvledger.connector.sim.driver import Storm

CONFIG = StormConfig(seed=4, mode="read", requests=300, concurrency=64, faults=frozenset())


def _short_defer(config: StormConfig) -> Storm:
    storm = Storm(config)
    scheduler = storm.producer.scheduler
    # Two rounds: the producer gives up while the consumer's read (after the proxy's delay) is still to land.
    scheduler.config = dataclasses.replace(scheduler.config, defer_timeout_s=2 * CONFIG.step_s)
    return storm


def test_a_defer_timeout_shorter_than_the_read_is_a_premature_release() -> None:
    # Without the refusal of reads of released blocks (and leases): what the audit reports after the fact.
    storm = _short_defer(dataclasses.replace(CONFIG, protections=False))
    result = evaluate(storm, storm.run())
    assert result.premature_releases > 0
    assert not result.ok and any("premature" in p for p in result.problems)


def test_with_the_refusal_on_a_too_short_defer_timeout_fails_reads_instead() -> None:
    storm = _short_defer(CONFIG)
    result = evaluate(storm, storm.run())
    assert result.premature_releases == 0 and result.integrity_failures == 0
    assert result.late_reads_refused > 0 and result.failed_recving >= result.late_reads_refused


class FreesAtRequestFinished(Storm):
    """A broken engine that frees the producer's blocks as soon as the request finishes, ignoring the ledger."""

    def _request_finished(self, round_number: int, now: float) -> None:
        finishing = list(self._finishing)
        super()._request_finished(round_number, now)
        for request in finishing:
            self.producer.pool.free(request.producer.blocks, request.transfer_id)


def test_blocks_reused_before_the_read_are_caught_by_the_checksums() -> None:
    storm = FreesAtRequestFinished(CONFIG)
    result = evaluate(storm, storm.run())
    assert result.integrity_failures > 0  # a new prefill overwrote them before the consumer read
    assert result.double_releases > 0  # and the ledger's own release freed them a second time
    assert not result.ok
