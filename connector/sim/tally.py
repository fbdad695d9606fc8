"""What the storm's driver counts while it runs (the checks after the run add the rest)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvledger.ledger.events import TransferId


@dataclass
class Tally:
    """What the driver counted while it ran (the checks after the run add the rest)."""

    rounds: int = 0
    final_now: float = 0.0
    wall_seconds: float = 0.0
    issued: int = 0
    double_reports: int = 0
    integrity_checked: int = 0
    integrity_failures: list[str] = field(default_factory=list)
    failed_reported_as_received: list[str] = field(default_factory=list)
    load_errors_missing: list[str] = field(default_factory=list)
    unknown_reports: list[str] = field(default_factory=list)
    """Reports naming a request the engine's vLLM does not hold (vLLM asserts `req_id in self.requests`)."""
    death_touched: set[TransferId] = field(default_factory=set)
    forged: set[TransferId] = field(default_factory=set)
    """Transfers whose producer got a forged release."""
    dead: str | None = None
    restarted: list[str] = field(default_factory=list)
    """Engines that died and came back with another layout (peer_restart_layout)."""
    horizon_reached: bool = False
