"""The entry points: `run_storm(StormConfig) -> StormResult` (what `kvledger demo` and the benchmark call) and
`run_soak(SoakConfig) -> SoakResult` (the long-horizon run, benchmarks/soak.py)."""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

from kvledger.connector.sim.check import evaluate
from kvledger.connector.sim.config import StormConfig, StormResult
from kvledger.connector.sim.driver import Storm
from kvledger.connector.sim.errors import SimulationError
from kvledger.connector.sim.soak_config import SoakConfig, SoakResult


def run_storm(config: StormConfig) -> StormResult:
    """Run one seeded storm to the end (every deadline passed), then check it. A broken invariant is a line in
    `result.problems`, never an exception; `SimulationError` means the harness itself failed."""
    try:
        storm = Storm(config)
        tally = storm.run()
    except SimulationError as error:
        raise SimulationError(f"seed {config.seed} {config.mode}: {error}") from error
    return evaluate(storm, tally)


def run_soak(config: SoakConfig) -> SoakResult:
    """Run one seeded soak to its end (`sim_hours` of arrivals, then every re-ask and restart played out), then
    check it. Without a `ledger_url`, the ledgers persist to a SQLite store in a temporary folder (restarts
    reopen them from there), removed afterwards."""
    from kvledger.connector.sim.soak import Soak
    from kvledger.connector.sim.soak_check import evaluate_soak

    with tempfile.TemporaryDirectory(prefix="kvledger-soak-") as folder:
        if config.ledger_url is None:
            config = dataclasses.replace(config, ledger_url=f"sqlite:///{Path(folder) / 'ledger.db'}")
        try:
            soak = Soak(config)
            soak.run()
        except SimulationError as error:
            raise SimulationError(f"soak seed {config.seed} {config.mode}: {error}") from error
        return evaluate_soak(soak, soak.tally)
