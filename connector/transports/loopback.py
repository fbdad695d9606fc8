"""An in-process transport: peers in one process, copies done at once. The contract's reference
implementation, and what the simulator uses where no sockets are wanted."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvledger.connector.transports.base import (
    SUCCEEDED,
    Code,
    HoldCheck,
    Op,
    RegionDescriptor,
    TransferHandle,
    TransportEndpoint,
    failed,
)
from kvledger.connector.transports.regions import RegionError, TensorRegion

BACKEND = "loopback"

_registry: dict[int, LoopbackTransport] = {}
_registry_lock = threading.Lock()
_ports = itertools.count(1)


@dataclass
class LoopbackSession:
    endpoint: TransportEndpoint
    regions: dict[str, RegionDescriptor] = field(default_factory=dict)


class LoopbackTransport:
    backend = BACKEND
    one_sided = False
    """The producer serves each read, so it refuses one for a transfer it no longer holds."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self._regions: dict[str, TensorRegion] = {}
        self._hold_check: HoldCheck | None = None
        self._closed = False
        with _registry_lock:
            port = next(_ports)
            _registry[port] = self
        self._endpoint = TransportEndpoint(backend=BACKEND, host=host, port=port)

    def register(self, name: str, tensor: Any) -> RegionDescriptor:
        region = TensorRegion(tensor)
        self._regions[name] = region
        return RegionDescriptor(name=name, size=region.size)

    def endpoint(self) -> TransportEndpoint:
        return self._endpoint

    def connect(self, endpoint: TransportEndpoint, regions: Sequence[RegionDescriptor]) -> LoopbackSession:
        if endpoint.backend != BACKEND:
            raise ValueError(f"a loopback transport cannot talk to a {endpoint.backend!r} endpoint")
        return LoopbackSession(endpoint, {r.name: r for r in regions})

    def read(
        self, session: Any, local: str, remote: str, ops: Sequence[Op], *, transfer_id: str = ""
    ) -> TransferHandle:
        return self._copy(session, local, remote, ops, into_local=True, transfer_id=transfer_id)

    def set_hold_check(self, held: HoldCheck | None) -> None:
        self._hold_check = held

    def write(self, session: Any, local: str, remote: str, ops: Sequence[Op]) -> TransferHandle:
        return self._copy(session, local, remote, ops, into_local=False)

    def wait_all(self, handles: Sequence[TransferHandle], timeout_s: float) -> bool:
        return all(h.wait(timeout_s) for h in handles)

    def close(self) -> None:
        self._closed = True
        with _registry_lock:
            _registry.pop(self._endpoint.port, None)

    def _copy(
        self, session: Any, local: str, remote: str, ops: Sequence[Op], *, into_local: bool, transfer_id: str = ""
    ) -> TransferHandle:
        if self._closed:
            return TransferHandle(failed(Code.CLOSED, "transport closed"))
        peer = _registry.get(session.endpoint.port)
        if peer is None:
            return TransferHandle(failed(Code.PEER_UNREACHABLE, f"no loopback peer at {session.endpoint.port}"))
        mine, theirs = self._regions.get(local), peer._regions.get(remote)
        if mine is None or theirs is None or remote not in session.regions:
            return TransferHandle(failed(Code.BAD_REQUEST, f"unknown region {local!r} or {remote!r}"))
        held = peer._hold_check
        answer = (held(transfer_id) if transfer_id else False) if into_local and held is not None else True
        if answer is None:
            return TransferHandle(failed(Code.NOT_HELD_YET, "transfer not held yet", transient=True))
        if answer is False:
            return TransferHandle(failed(Code.REFUSED, "transfer not held by the producer: no bytes sent"))
        try:
            for lo, ro, size in ops:
                mine.check(lo, size)
                theirs.check(ro, size)
            for lo, ro, size in ops:
                if into_local:
                    mine.store(lo, bytes(theirs.view(ro, size)))
                else:
                    theirs.store(ro, bytes(mine.view(lo, size)))
        except RegionError as error:
            return TransferHandle(failed(Code.BAD_REQUEST, str(error)))
        return TransferHandle(SUCCEEDED)
