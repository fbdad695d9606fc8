"""A seeded P/D simulator: a producer and a consumer connector under a fault storm, audited, beside naive bookkeeping.

`run_storm(StormConfig(...)) -> StormResult` is the entry point. Names are resolved lazily so that importing
the package (the CLI) loads torch and zmq only when a storm runs.
"""

from __future__ import annotations

from typing import Any

__all__ = ["FAULT_KINDS", "SimulationError", "StormConfig", "StormResult", "run_storm"]


def __getattr__(name: str) -> Any:
    if name == "run_storm":
        from connector.sim.storm import run_storm

        return run_storm
    if name == "SimulationError":
        from connector.sim.errors import SimulationError

        return SimulationError
    if name in ("StormConfig", "StormResult", "FAULT_KINDS"):
        from connector.sim import config

        return getattr(config, name)
    raise AttributeError(f"module 'connector.sim' has no attribute {name!r}")
