"""What the simulated network knows: which endpoints died, where the silent peer listens, and each transfer's fault
plan."""

from __future__ import annotations

from collections.abc import Iterable

from kvledger.connector.sim.faults import NO_FAULTS, TransferFaults
from kvledger.connector.transports.base import TransportEndpoint
from kvledger.ledger.events import TransferId


class SimNetwork:
    """Shared by both engines' channel and transport wrappers (all called from the driver's one thread)."""

    def __init__(self) -> None:
        self.plans: dict[TransferId, TransferFaults] = {}
        self.transfers: set[TransferId] = set()
        """Every transfer this storm issued: a message naming another came from outside the simulation."""
        self._dead: set[tuple[str, int]] = set()
        self.silent: TransportEndpoint | None = None
        """Where the transport requests of a transfer with the `silent_peer` fault go (`SilentPeer`): taken,
        never answered."""

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

    def is_silent(self, host: str, port: int) -> bool:
        silent = self.silent
        return silent is not None and (silent.host, silent.port) == (host, port)
