"""A small seed sweep in CI (the benchmark's `--seeds 1-200` runs the long one): every seed passes."""

from __future__ import annotations

from kvledger.connector.sim.config import StormConfig
from kvledger.connector.sim.storm import run_storm

SEEDS = range(1, 16)


def test_every_seed_passes() -> None:
    failed = []
    for seed in SEEDS:
        for mode in ("read", "write"):
            result = run_storm(StormConfig(seed=seed, mode=mode, requests=400, concurrency=96))
            if not result.ok:
                failed.append(f"seed {seed} {mode}: {result.problems}")
    assert not failed, "\n".join(failed)
