"""A seeded P/D simulator: a producer and a consumer connector under a fault storm, audited, beside naive bookkeeping.

`run_storm(StormConfig(...)) -> StormResult` and `run_soak(SoakConfig(...)) -> SoakResult` (hours of simulated
time) are the entry points. Names are resolved lazily so that importing the package (the CLI) loads torch
and zmq only when a storm runs.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "FAULT_KINDS",
    "SOAK_FAULT_KINDS",
    "SimulationError",
    "SoakConfig",
    "SoakResult",
    "StormConfig",
    "StormResult",
    "run_soak",
    "run_storm",
]


def __getattr__(name: str) -> Any:
    if name in ("run_storm", "run_soak"):
        from kvledger.connector.sim import storm

        return getattr(storm, name)
    if name == "SimulationError":
        from kvledger.connector.sim.errors import SimulationError

        return SimulationError
    if name in ("StormConfig", "StormResult", "FAULT_KINDS"):
        from kvledger.connector.sim import config

        return getattr(config, name)
    if name in ("SoakConfig", "SoakResult", "SOAK_FAULT_KINDS"):
        from kvledger.connector.sim import soak_config

        return getattr(soak_config, name)
    raise AttributeError(f"module 'kvledger.connector.sim' has no attribute {name!r}")
