"""The entry point: `run_storm(StormConfig) -> StormResult` (what `kvledger demo` and the benchmark call)."""

from __future__ import annotations

from connector.sim.check import evaluate
from connector.sim.config import StormConfig, StormResult
from connector.sim.driver import Storm
from connector.sim.errors import SimulationError


def run_storm(config: StormConfig) -> StormResult:
    """Run one seeded storm to the end (every deadline passed), then check it. A broken invariant is a line in
    `result.problems`, never an exception; `SimulationError` means the harness itself failed."""
    try:
        storm = Storm(config)
        tally = storm.run()
    except SimulationError as error:
        raise SimulationError(f"seed {config.seed} {config.mode}: {error}") from error
    return evaluate(storm, tally)
