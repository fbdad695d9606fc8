"""A transport wrapper: injected send-queue-full and terminal failures, and handles gated by rounds.

Every handle it returns reads "in progress" until the driver opens it at a round
boundary, after the real transfer finished; so whether the worker sees a read or
write done in a given poll depends on rounds, never on thread timing. Handles to
a dead engine never finish (as with a peer that vanished mid-transfer) and are
never waited on. Faults are per transfer: the op's first local block names its
owner, through the engine's block pool. A `silent_peer` transfer's ops go through
the real transport to the silent peer (`SilentPeer`): they take real in-flight
slots, never finish, and are never waited on either.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from kvledger.connector.limits import TRANSPORT_INFLIGHT_MAX, TRANSPORT_INFLIGHT_PER_PEER_MAX
from kvledger.connector.sim.config import StormConfig
from kvledger.connector.sim.errors import SimulationError
from kvledger.connector.sim.network import SimNetwork
from kvledger.connector.transports.base import (
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
from kvledger.ledger.events import TransferId


def tcp_limits(storm: StormConfig) -> dict[str, Any]:
    """The real tcp transport's bounds in a storm: `transport_inflight_max` in total and a quarter of it per peer,
    as the limits' are. The negative control (`protections` off) runs the transport as it was: one bound over
    every peer and no deadline. With protections the deadline is the transport's default, longer than a round's
    settle bound (SETTLE_TIMEOUT_S), so a slow host never times out an op of a live peer: the storm's clock
    decides failures; a silent peer's slots come back when the worker gives its requests up."""
    total = storm.transport_inflight_max
    if not storm.protections:
        return {"inflight_max": total, "inflight_per_peer_max": total, "request_timeout_s": math.inf}
    per_peer = max(1, total * TRANSPORT_INFLIGHT_PER_PEER_MAX // TRANSPORT_INFLIGHT_MAX)
    return {"inflight_max": total, "inflight_per_peer_max": per_peer}


class GatedHandle(TransferHandle):
    __slots__ = ("endpoint", "forward_cancel", "inner", "opened")

    def __init__(self, inner: TransferHandle, endpoint: TransportEndpoint, *, forward_cancel: bool = True) -> None:
        super().__init__()
        self.inner = inner
        self.endpoint = endpoint
        self.opened = False
        self.forward_cancel = forward_cancel

    def status(self) -> TransferStatus:
        return self.inner.status() if self.opened else IN_PROGRESS

    def wait(self, timeout_s: float) -> bool:
        return self.opened and self.inner.wait(timeout_s)

    def cancel(self) -> None:
        """The worker gives the batch up: the real handle is told (so its transport frees the slot), unless the
        storm runs the negative control, whose connector kept its handles in flight until a reply."""
        if self.forward_cancel:
            self.inner.cancel()
        super().cancel()


class FaultyTransport:
    def __init__(
        self,
        inner: Transport,
        network: SimNetwork,
        owner_of: Callable[[str, int], TransferId | None],
        *,
        forward_cancel: bool = True,
    ) -> None:
        """`forward_cancel` False: the negative control's connector, which never gave a request up (its slot
        came back only with a reply)."""
        self.inner = inner
        self.forward_cancel = forward_cancel
        self.backend = inner.backend
        self.network = network
        self._owner_of = owner_of
        self._ops: Counter[TransferId] = Counter()
        self.injected: Counter[str] = Counter()
        self.failed_terminally: set[TransferId] = set()
        self._gated: list[GatedHandle] = []
        self.hung: list[GatedHandle] = []
        """Handles to a dead engine or the silent peer: they never finish."""
        self.silent_sent = 0
        """Ops that went to the silent peer (`silent_peer`; those the transport refused a slot did not)."""
        self.slots_refused: Counter[TransferId] = Counter()
        """Per transfer, ops the real transport refused an in-flight slot (SEND_QUEUE_FULL, not injected)."""
        self._silent_sessions: dict[tuple[str, int], Session] = {}

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
            session, local, ops, lambda to: self.inner.read(to, local, remote, ops, transfer_id=transfer_id)
        )

    def set_hold_check(self, held: HoldCheck | None) -> None:
        self.inner.set_hold_check(held)

    def write(self, session: Session, local: str, remote: str, ops: Sequence[Op]) -> TransferHandle:
        return self._issue(session, local, ops, lambda to: self.inner.write(to, local, remote, ops))

    def inflight(self) -> int:
        """The real transport's requests holding an in-flight slot (0 for one that does not count them)."""
        count = getattr(self.inner, "inflight", None)
        return int(count()) if count is not None else 0

    def wait_all(self, handles: Sequence[TransferHandle], timeout_s: float) -> bool:
        return all(h.wait(timeout_s) for h in handles)

    def close(self) -> None:
        self.inner.close()

    def _issue(
        self, session: Session, local: str, ops: Sequence[Op], call: Callable[[Session], TransferHandle]
    ) -> TransferHandle:
        """`call(session)` issues the op on the real transport, to `session`'s peer or another."""
        tid = self._owner_of(local, ops[0][0]) if ops else None
        faults = self.network.faults(tid)
        handle: TransferHandle
        endpoint = session.endpoint
        if self.network.is_dead(session.endpoint.host, session.endpoint.port):
            handle = TransferHandle()  # a dead engine never answers; nothing goes on the wire
        elif tid is not None and faults.silent and self.network.silent is not None:
            to = self._silent_session(session)
            endpoint = to.endpoint
            handle = call(to)
            self.silent_sent += handle.status().in_progress()  # not refused a slot: it went
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
                handle = self._real(call, session, tid)
        else:
            handle = self._real(call, session, tid)
        gated = GatedHandle(handle, endpoint, forward_cancel=self.forward_cancel)
        self._gated.append(gated)
        return gated

    def _real(
        self, call: Callable[[Session], TransferHandle], session: Session, tid: TransferId | None
    ) -> TransferHandle:
        """The op on the real transport, to its peer; a slot refused is noted (starvation, where no fault of the
        transfer's own explains it)."""
        handle = call(session)
        status = handle.status()
        if tid is not None and status.code == Code.SEND_QUEUE_FULL and status.failed():
            self.slots_refused[tid] += 1
        return handle

    def _silent_session(self, session: Session) -> Session:
        """A session with the silent peer that names the same regions as `session` (one per peer)."""
        key = (session.endpoint.host, session.endpoint.port)
        silent = self._silent_sessions.get(key)
        if silent is None:
            assert self.network.silent is not None
            regions = list(getattr(session, "regions", {}).values())
            silent = self._silent_sessions[key] = self.inner.connect(self.network.silent, regions)
        return silent

    # -- the round boundary -------------------------------------------------------

    def settle(self, deadline: float, clock: Callable[[], float]) -> None:
        """Wait (bounded by `deadline` on `clock`) for every real transfer issued this round to finish."""
        for handle in self._gated:
            if self._never_answered(handle):
                continue
            if not handle.inner.wait(max(0.0, deadline - clock())):
                raise SimulationError(f"a transport op to {handle.endpoint.host}:{handle.endpoint.port} never finished")

    def open(self) -> None:
        """Show every finished handle to the worker; those to a dead engine or the silent peer stay in progress
        for ever (the real one fails at its deadline, in real time: the storm's clock decides, never that).

        An op to an engine that died this round stays in progress even if the dead engine's
        server thread still answered it before stopping: whether it did is thread timing, and
        the run must not depend on it (the same seed must give the same run).
        """
        for handle in self._gated:
            if self._never_answered(handle) or handle.inner.status().in_progress():
                self.hung.append(handle)
            else:
                handle.opened = True
        self._gated.clear()

    def _never_answered(self, handle: GatedHandle) -> bool:
        """An op to a dead engine or to the silent peer: no answer comes, so none is waited for."""
        host, port = handle.endpoint.host, handle.endpoint.port
        return self.network.is_dead(host, port) or self.network.is_silent(host, port)
