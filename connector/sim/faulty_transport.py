"""A transport wrapper: injected send-queue-full and terminal failures, and handles gated by rounds.

Every handle it returns reads "in progress" until the driver opens it at a round
boundary, after the real transfer finished; so whether the worker sees a read or
write done in a given poll depends on rounds, never on thread timing. Handles to
a dead engine never finish (as with a peer that vanished mid-transfer) and are
never waited on. Faults are per transfer: the op's first local block names its
owner, through the engine's block pool.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from connector.sim.errors import SimulationError
from connector.sim.network import SimNetwork
from connector.transports.base import (
    IN_PROGRESS,
    Code,
    HoldCheck,
    Op,
    RegionDescriptor,
    Session,
    TransferHandle,
    TransferStatus,
    Transport,
    TransportEndpoint,
    failed,
)
from ledger.events import TransferId


class GatedHandle(TransferHandle):
    __slots__ = ("endpoint", "inner", "opened")

    def __init__(self, inner: TransferHandle, endpoint: TransportEndpoint) -> None:
        super().__init__()
        self.inner = inner
        self.endpoint = endpoint
        self.opened = False

    def status(self) -> TransferStatus:
        return self.inner.status() if self.opened else IN_PROGRESS

    def wait(self, timeout_s: float) -> bool:
        return self.opened and self.inner.wait(timeout_s)


class FaultyTransport:
    def __init__(
        self,
        inner: Transport,
        network: SimNetwork,
        owner_of: Callable[[str, int], TransferId | None],
    ) -> None:
        self.inner = inner
        self.backend = inner.backend
        self.network = network
        self._owner_of = owner_of
        self._ops: Counter[TransferId] = Counter()
        self.injected: Counter[str] = Counter()
        self.failed_terminally: set[TransferId] = set()
        self._gated: list[GatedHandle] = []
        self.hung: list[GatedHandle] = []
        """Handles to a dead engine: they never finish."""

    @property
    def one_sided(self) -> bool:
        return self.inner.one_sided

    def register(self, name: str, tensor: Any) -> RegionDescriptor:
        return self.inner.register(name, tensor)

    def endpoint(self) -> TransportEndpoint:
        return self.inner.endpoint()

    def connect(self, endpoint: TransportEndpoint, regions: Sequence[RegionDescriptor]) -> Session:
        return self.inner.connect(endpoint, regions)

    def read(
        self, session: Session, local: str, remote: str, ops: Sequence[Op], *, transfer_id: str = ""
    ) -> TransferHandle:
        return self._issue(
            session, local, ops, lambda: self.inner.read(session, local, remote, ops, transfer_id=transfer_id)
        )

    def set_hold_check(self, held: HoldCheck | None) -> None:
        self.inner.set_hold_check(held)

    def write(self, session: Session, local: str, remote: str, ops: Sequence[Op]) -> TransferHandle:
        return self._issue(session, local, ops, lambda: self.inner.write(session, local, remote, ops))

    def wait_all(self, handles: Sequence[TransferHandle], timeout_s: float) -> bool:
        return all(h.wait(timeout_s) for h in handles)

    def close(self) -> None:
        self.inner.close()

    def _issue(
        self, session: Session, local: str, ops: Sequence[Op], call: Callable[[], TransferHandle]
    ) -> TransferHandle:
        tid = self._owner_of(local, ops[0][0]) if ops else None
        faults = self.network.faults(tid)
        handle: TransferHandle
        if self.network.is_dead(session.endpoint.host, session.endpoint.port):
            handle = TransferHandle()  # a dead engine never answers; nothing goes on the wire
        elif tid is not None and (faults.sq_full_ops or faults.terminal):
            n = self._ops[tid]
            self._ops[tid] = n + 1
            if n < faults.sq_full_ops:
                self.injected["sq_full"] += 1
                handle = TransferHandle(failed(Code.SEND_QUEUE_FULL, "SQ full (injected)", transient=True))
            elif faults.terminal and n == faults.sq_full_ops:
                self.injected["transfer_fail"] += 1
                self.failed_terminally.add(tid)
                handle = TransferHandle(failed(Code.REMOTE_ERROR, "transfer failed (injected)"))
            else:
                handle = call()
        else:
            handle = call()
        gated = GatedHandle(handle, session.endpoint)
        self._gated.append(gated)
        return gated

    # -- the round boundary -------------------------------------------------------

    def settle(self, deadline: float, clock: Callable[[], float]) -> None:
        """Wait (bounded by `deadline` on `clock`) for every real transfer issued this round to finish."""
        for handle in self._gated:
            if self.network.is_dead(handle.endpoint.host, handle.endpoint.port):
                continue
            if not handle.inner.wait(max(0.0, deadline - clock())):
                raise SimulationError(f"a transport op to {handle.endpoint.host}:{handle.endpoint.port} never finished")

    def open(self) -> None:
        """Show every finished handle to the worker; those to a dead engine stay in progress for ever.

        An op to an engine that died this round stays in progress even if the dead engine's
        server thread still answered it before stopping: whether it did is thread timing, and
        the run must not depend on it (the same seed must give the same run).
        """
        for handle in self._gated:
            dead = self.network.is_dead(handle.endpoint.host, handle.endpoint.port)
            if dead or handle.inner.status().in_progress():
                self.hung.append(handle)
            else:
                handle.opened = True
        self._gated.clear()
