"""What the simulated network knows: which endpoints died, and each transfer's fault plan."""

from __future__ import annotations

from collections.abc import Iterable

from connector.sim.faults import NO_FAULTS, TransferFaults
from ledger.events import TransferId


class SimNetwork:
    """Shared by both engines' channel and transport wrappers (all called from the driver's one thread)."""

    def __init__(self) -> None:
        self.plans: dict[TransferId, TransferFaults] = {}
        self.transfers: set[TransferId] = set()
        """Every transfer this storm issued: a message naming another came from outside the simulation."""
        self._dead: set[tuple[str, int]] = set()

    def faults(self, transfer_id: TransferId | None) -> TransferFaults:
        if transfer_id is None:
            return NO_FAULTS
        return self.plans.get(transfer_id, NO_FAULTS)

    def kill(self, endpoints: Iterable[tuple[str, int]]) -> None:
        self._dead.update(endpoints)

    def revive(self, endpoints: Iterable[tuple[str, int]]) -> None:
        """A restarted engine listens on these again."""
        self._dead.difference_update(endpoints)

    def is_dead(self, host: str, port: int) -> bool:
        return (host, port) in self._dead
