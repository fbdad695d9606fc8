"""The simulator's one exception."""

from __future__ import annotations


class SimulationError(RuntimeError):
    """The simulated world broke (a round's bytes never landed, a pool ran dry): a harness failure, not a
    finding about the connector. The message names the seed and mode."""
