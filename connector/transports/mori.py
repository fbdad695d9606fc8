"""The mori transport: the contract (base.py) on mori.io's IOEngine over RDMA or XGMI; untested on ROCm hardware here.

`register` is `register_torch_tensor` (its packed MemoryDesc travels in the region
descriptor), the endpoint carries the packed EngineDesc, `connect` registers the peer
engine, and each (local, remote) region pair gets one mori session, created at its first
batch. `read`/`write` are `batch_read`/`batch_write`; the handle polls mori's status
(`Succeeded()`/`Failed()`, `Code()`, `Message()`) when asked, so no thread is started
here: mori's own workers move the bytes. `mori.io` is imported only when a transport is
built, and a missing or unloadable mori (ImportError, or OSError without ROCm) becomes a
`MoriUnavailableError` naming the backend and the cause.
"""

from __future__ import annotations

import importlib
import itertools
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from kvledger.connector.limits import (
    MORI_CLOSE_GRACE_S,
    MORI_INFLIGHT_MAX,
    MORI_OPS_PER_BATCH_MAX,
    MORI_POLL_INTERVAL_S,
    MORI_POST_BATCH_SIZE,
    MORI_QP_PER_TRANSFER,
    MORI_WAIT_SLICE_S,
    MORI_WORKER_THREADS,
)
from kvledger.connector.transports.base import (
    SUCCEEDED,
    Code,
    HoldCheck,
    Op,
    RegionDescriptor,
    TransferHandle,
    TransferStatus,
    TransportEndpoint,
    check_ops,
    failed,
)
from kvledger.connector.transports.regions import TensorRegion

log = logging.getLogger(__name__)

BACKEND = "mori"

FABRICS = ("rdma", "xgmi")
"""mori backends this transport can create: RDMA between nodes, XGMI between GPUs of one node."""


SEND_QUEUE_FULL_MESSAGE = "sq full"
"""Lower-cased text mori puts in Message() when its RDMA send queue stays full (src/io/rdma/common.cpp)."""

SEND_QUEUE_FULL_CODE_NAMES = ("ERR_SQ_FULL", "ERR_SEND_QUEUE_FULL")
"""StatusCode names that would mean send-queue-full; mori (at 624002c) has none and reports ERR_RDMA_OP."""

_TERMINAL_CODES = {"ERR_INVALID_ARGS": Code.BAD_REQUEST, "ERR_NOT_FOUND": Code.BAD_REQUEST}
"""mori status code names that mean a bad request; every other failure is a remote (transfer) error."""

_engine_numbers = itertools.count()


class MoriUnavailableError(RuntimeError):
    """The mori backend was selected but mori.io cannot be imported or its backend cannot be created."""


def load_mori_io() -> ModuleType:
    """`mori.io`, or a MoriUnavailableError naming the backend and the cause."""
    try:
        return importlib.import_module("mori.io")
    except (ImportError, OSError) as error:  # OSError: mori is installed but ROCm's libraries are not
        raise MoriUnavailableError(
            f"transport backend {BACKEND!r} was selected but `import mori.io` failed with "
            f"{type(error).__name__}: {error}. mori needs ROCm (HIP and RDMA libraries); "
            "install it on a ROCm host, or choose backend 'tcp'."
        ) from error


def send_queue_full_codes(mori_io: ModuleType) -> frozenset[int]:
    """The values of this mori's dedicated send-queue-full status codes (empty for today's mori)."""
    codes = mori_io.StatusCode
    return frozenset(int(getattr(codes, name)) for name in SEND_QUEUE_FULL_CODE_NAMES if hasattr(codes, name))


def failure_status(code: Any, message: str, sq_full_codes: frozenset[int]) -> TransferStatus:
    """A failed mori status as ours: send-queue-full is transient, everything else terminal.

    By status code where this mori has a dedicated one, else by its message ("SQ full",
    any case); "SQ request exceeds capacity" does not match, rightly: it never fits.
    """
    name = getattr(code, "name", str(code))
    text = f"mori {name}: {message}" if message else f"mori {name}"
    if _is_send_queue_full(code, message, sq_full_codes):
        return failed(Code.SEND_QUEUE_FULL, text, transient=True)
    return failed(_TERMINAL_CODES.get(name, Code.REMOTE_ERROR), text)


def _is_send_queue_full(code: Any, message: str, sq_full_codes: frozenset[int]) -> bool:
    if sq_full_codes:  # this mori has a dedicated code: the code decides
        return _code_value(code) in sq_full_codes
    return SEND_QUEUE_FULL_MESSAGE in message.lower()


def _code_value(code: Any) -> int | None:
    try:
        return int(code)
    except (TypeError, ValueError):
        return None


class MoriHandle(TransferHandle):
    """A batch's handle that reads mori's status when polled or waited on (safe from any thread)."""

    __slots__ = ("_mori_status", "_sq_full_codes")

    def __init__(self, mori_status: Any, sq_full_codes: frozenset[int]) -> None:
        super().__init__()
        self._mori_status = mori_status
        self._sq_full_codes = sq_full_codes

    @property
    def mori_status(self) -> Any:
        return self._mori_status

    def status(self) -> TransferStatus:
        self._refresh()
        return super().status()

    def wait(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.status().in_progress():
                return True
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                return False
            self._block(min(remaining_s, MORI_WAIT_SLICE_S))

    def cancel(self) -> None:
        """Nothing: the NIC finishes a posted batch whatever the caller wants, so it stays in flight (counted
        against MORI_INFLIGHT_MAX, waited for at close) until mori reports it; the caller just stops reading it."""

    def _refresh(self) -> None:
        if not super().status().in_progress():
            return  # the first outcome wins, a close's included
        mori_status = self._mori_status
        if mori_status.Succeeded():
            self.finish(SUCCEEDED)
        elif mori_status.Failed():
            self.finish(failure_status(mori_status.Code(), mori_status.Message(), self._sq_full_codes))

    def _block(self, seconds: float) -> None:
        wait_for = getattr(self._mori_status, "WaitFor", None)
        if wait_for is not None and self._mori_status.InProgress():
            wait_for(max(1, int(seconds * 1000)))  # releases the GIL in real mori
        else:
            time.sleep(min(seconds, MORI_POLL_INTERVAL_S))


@dataclass
class _LocalRegion:
    number: int
    """Distinct per registration, so a session made for a replaced tensor is never reused."""
    region: TensorRegion
    memory: Any


@dataclass
class MoriSession:
    endpoint: TransportEndpoint
    engine_key: str
    regions: dict[str, RegionDescriptor] = field(default_factory=dict)
    links: dict[tuple[int, str], Any] = field(default_factory=dict)
    """(local registration number, remote region name) -> mori IOEngineSession."""


class MoriTransport:
    """See the module docstring. `mori_io` injects a module (tests pass the fake); else `mori.io` is imported."""

    backend = BACKEND
    one_sided = True
    """RDMA reads never reach the producer's CPU: the worker confirms the hold before and after instead."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        fabric: str = "rdma",
        engine_key: str | None = None,
        close_grace_s: float = MORI_CLOSE_GRACE_S,
        mori_io: ModuleType | None = None,
    ) -> None:
        if fabric not in FABRICS:
            raise ValueError(f"mori fabric must be one of {list(FABRICS)}, got {fabric!r}")
        io = mori_io if mori_io is not None else load_mori_io()
        self._io = io
        self._sq_full_codes = send_queue_full_codes(io)
        self._close_grace_s = close_grace_s
        key = engine_key or f"kvledger:{host}:{port}:{os.getpid()}:{next(_engine_numbers)}"
        self._engine = io.IOEngine(key, io.IOEngineConfig(host, port))
        try:
            if fabric == "xgmi":
                self._engine.create_backend(io.BackendType.XGMI)
            else:
                # Notifications off, as MoRIIO does: completion travels over our ZMQ channel, and with
                # them on an ENOMEM from ibv_post_send can poison a status before its data lands.
                config = io.RdmaBackendConfig(
                    MORI_QP_PER_TRANSFER,
                    MORI_POST_BATCH_SIZE,
                    MORI_WORKER_THREADS,
                    io.PollCqMode.POLLING,
                    enable_notification=False,
                )
                self._engine.create_backend(io.BackendType.RDMA, config)
        except RuntimeError as error:  # no RDMA device, no GPU peer access...
            raise MoriUnavailableError(
                f"transport backend {BACKEND!r}: creating its {fabric} backend failed: {error}"
            ) from error
        desc = self._engine.get_engine_desc()
        self._endpoint = TransportEndpoint(backend=BACKEND, host=host, port=int(desc.port or port), extra=desc.pack())
        self._regions: dict[str, _LocalRegion] = {}
        self._region_numbers = itertools.count()
        self._remote_engines: dict[str, Any] = {}
        self._inflight: list[MoriHandle] = []
        self._closed = False

    # -- the contract ---------------------------------------------------------

    def register(self, name: str, tensor: torch.Tensor) -> RegionDescriptor:
        region = TensorRegion(tensor)  # bounds for our checks; keeps the tensor alive while peers address it
        if tensor.is_contiguous():
            memory = self._engine.register_torch_tensor(tensor)
        else:
            memory = self._register_extent(name, tensor, region.size)
        old = self._regions.get(name)
        if old is not None:
            self._engine.deregister_memory(old.memory)
        self._regions[name] = _LocalRegion(next(self._region_numbers), region, memory)
        return RegionDescriptor(name=name, size=region.size, extra=memory.pack())

    def endpoint(self) -> TransportEndpoint:
        return self._endpoint

    def connect(self, endpoint: TransportEndpoint, regions: Sequence[RegionDescriptor]) -> MoriSession:
        if endpoint.backend != BACKEND:
            raise ValueError(f"a mori transport cannot talk to a {endpoint.backend!r} endpoint")
        if not endpoint.extra:
            raise ValueError(f"mori endpoint {endpoint.host}:{endpoint.port} carries no engine descriptor")
        engine_desc = self._io.EngineDesc.unpack(endpoint.extra)
        if engine_desc.key not in self._remote_engines:
            self._engine.register_remote_engine(engine_desc)
            self._remote_engines[engine_desc.key] = engine_desc
        return MoriSession(endpoint, engine_desc.key, {r.name: r for r in regions})

    def read(
        self, session: Any, local: str, remote: str, ops: Sequence[Op], *, transfer_id: str = ""
    ) -> TransferHandle:
        # One-sided: the producer's CPU never sees this read, so it cannot refuse it. The worker confirms the
        # hold with the producer before and after instead (`transfer_id` is not sent anywhere).
        return self._submit(session, local, remote, ops, read=True)

    def set_hold_check(self, held: HoldCheck | None) -> None:
        """Nothing to check on this side: an RDMA read never reaches the producer's CPU."""

    def write(self, session: Any, local: str, remote: str, ops: Sequence[Op]) -> TransferHandle:
        return self._submit(session, local, remote, ops, read=False)

    def wait_all(self, handles: Sequence[TransferHandle], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        pending = [h.mori_status for h in handles if isinstance(h, MoriHandle) and h.status().in_progress()]
        engine_wait_all = getattr(self._engine, "wait_all", None)
        if pending and engine_wait_all is not None and not self._closed:
            # One native wait for the batch; its code is not trusted, each handle reads its own status below.
            engine_wait_all(pending, max(0, int(timeout_s * 1000)))
        return all(h.wait(max(0.0, deadline - time.monotonic())) for h in handles)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        live = [h for h in self._inflight if h.status().in_progress()]
        if live and not self.wait_all(live, self._close_grace_s):
            log.warning("mori transport closed with %d batches still in flight", len(live))
        for handle in self._inflight:
            handle.finish(failed(Code.CLOSED, "transport closed"))  # no-op for those already finished
        self._inflight.clear()
        for local in self._regions.values():
            self._quietly(self._engine.deregister_memory, local.memory)
        for engine_desc in self._remote_engines.values():
            self._quietly(self._engine.deregister_remote_engine, engine_desc)
        self._regions.clear()
        self._remote_engines.clear()

    # -- the caller's side ----------------------------------------------------

    def _submit(self, session: Any, local: str, remote: str, ops: Sequence[Op], *, read: bool) -> TransferHandle:
        if self._closed:
            return TransferHandle(failed(Code.CLOSED, "transport closed"))
        checked = self._check(session, local, remote, ops)
        if isinstance(checked, TransferStatus):
            return TransferHandle(checked)
        if not ops:
            return TransferHandle(SUCCEEDED)
        link = self._link(session, checked, remote)
        if isinstance(link, TransferStatus):
            return TransferHandle(link)
        if len(self._inflight) >= MORI_INFLIGHT_MAX:
            self._inflight = [h for h in self._inflight if h.status().in_progress()]
            if len(self._inflight) >= MORI_INFLIGHT_MAX:
                return TransferHandle(
                    failed(Code.SEND_QUEUE_FULL, f"{MORI_INFLIGHT_MAX} mori batches in flight", transient=True)
                )
        local_offsets = [lo for lo, _, _ in ops]
        remote_offsets = [ro for _, ro, _ in ops]
        sizes = [size for _, _, size in ops]
        try:
            uid = self._engine.allocate_transfer_uid()
            batch = link.batch_read if read else link.batch_write
            mori_status = batch(local_offsets, remote_offsets, sizes, uid)
        except (RuntimeError, TypeError, ValueError) as error:  # pybind's errors for arguments it refuses
            return TransferHandle(failed(Code.REMOTE_ERROR, f"mori batch_{'read' if read else 'write'}: {error}"))
        handle = MoriHandle(mori_status, self._sq_full_codes)
        self._inflight.append(handle)
        return handle

    def _check(self, session: Any, local: str, remote: str, ops: Sequence[Op]) -> _LocalRegion | TransferStatus:
        """Refuse what RDMA would turn into a remote access error, with a message naming the op."""
        mine = self._regions.get(local)
        problem = check_ops(
            local, mine.region.size if mine else None, remote, session.regions.get(remote), ops,
            ops_max=MORI_OPS_PER_BATCH_MAX,
        )  # fmt: skip
        if problem is not None:
            return problem
        assert mine is not None
        return mine

    def _link(self, session: MoriSession, mine: _LocalRegion, remote: str) -> Any:
        """The mori session for this region pair, made once; a failed status if mori has no route."""
        key = (mine.number, remote)
        link = session.links.get(key)
        if link is not None:
            return link
        descriptor = session.regions[remote]
        if not descriptor.extra:
            return failed(Code.BAD_REQUEST, f"peer region {remote!r} carries no mori memory descriptor")
        remote_memory = self._io.MemoryDesc.unpack(descriptor.extra)
        link = self._engine.create_session(mine.memory, remote_memory)
        if link is None:
            return failed(Code.PEER_UNREACHABLE, f"mori has no backend that reaches {remote!r} on {session.engine_key}")
        session.links[key] = link
        return link

    def _register_extent(self, name: str, tensor: torch.Tensor, size: int) -> Any:
        """A strided view (a K or V half) registered by address and extent; mori's tensor call wants contiguity."""
        register_memory = getattr(self._engine, "register_memory", None)
        if register_memory is None:
            raise ValueError(f"region {name!r} is not contiguous and this mori has no register_memory")
        location = self._io.MemoryLocationType.CPU if tensor.device.type == "cpu" else self._io.MemoryLocationType.GPU
        device_id = tensor.device.index if tensor.device.index is not None else -1
        return register_memory(tensor.data_ptr(), size, device_id, location)

    @staticmethod
    def _quietly(call: Any, argument: Any) -> None:
        try:
            call(argument)
        except RuntimeError as error:  # tearing down: log, keep releasing the rest
            log.warning("mori transport close: %s", error)
