"""A FAKE `mori.io` for tests only: mori needs ROCm hardware (HIP, RDMA NICs), which CI does not have.

It follows the public names, signatures and status semantics of the real module as read
from ROCm/mori at commit 624002c897a30928ec04c14fc167bf2b8a93f6ce: `python/mori/io/engine.py`
and `python/mori/io/__init__.py` (IOEngine, IOEngineSession, register_torch_tensor,
create_session, batch_read/batch_write, wait_all), `src/pybind/pybind_io.cpp` (enum values,
config constructors and keyword names, TransferStatus methods), `include/mori/io/common.hpp`
and `enum.hpp` (TransferStatus: Failed() is code > ERR_BEGIN, Update() never overwrites an
error, WaitFor(0) polls once; EngineDesc / MemoryDesc fields), and `src/io/rdma/common.cpp`
(a full send queue is reported as ERR_RDMA_OP with "SQ full (<op>): ..." in the message;
there is no dedicated status code). Usage was checked against vLLM's MoRIIO connector
(`vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_engine.py` at commit
028a39c286ca87e0d302e66eda00bdb1a00b8c03). No code was copied.

What is fake: engines live in one process and find each other through a process-global
registry keyed by engine key; bytes move by memmove between registered host (CPU) memory;
pack() is JSON, not msgpack; any created backend (RDMA or XGMI) reaches any host memory;
inbound-transfer notifications are not modelled. The module-level `faults` injector makes
the next batches fail (send-queue-full or terminal, at submission or on completion) and
decides how in-progress batches complete (after a number of polls, or on a background
thread once a gate opens) so that callers' polling paths run.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import os
import socket
import threading
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from enum import IntEnum
from typing import Any


class BackendType(IntEnum):
    Unknown = 0
    XGMI = 1
    RDMA = 2
    TCP = 3
    FABRIC = 4


class MemoryLocationType(IntEnum):
    Unknown = 0
    CPU = 1
    GPU = 2


class StatusCode(IntEnum):
    SUCCESS = 0
    INIT = 1
    IN_PROGRESS = 2
    ERR_INVALID_ARGS = 11
    ERR_NOT_FOUND = 12
    ERR_RDMA_OP = 13
    ERR_BAD_STATE = 14
    ERR_GPU_OP = 15


ERR_BEGIN = 10
"""Every code above this is a failure (the C++ enum's ERR_BEGIN; pybind does not export it)."""


class PollCqMode(IntEnum):
    POLLING = 0
    EVENT = 1


GATE_TIMEOUT_S = 30.0
"""A held background completion gives up (ERR_BAD_STATE) after this, so a forgotten release cannot hang a test."""


def sq_full_message(op_tag: str = "batch") -> str:
    """The message real mori puts on an ERR_RDMA_OP status when the RDMA send queue stays full."""
    return f"SQ full ({op_tag}): ep=0 depth=256 requested=1 max=256"


@dataclass
class IOEngineConfig:
    host: str = ""
    port: int = 0


@dataclass
class RdmaBackendConfig:
    qp_per_transfer: int = 1
    post_batch_size: int = -1
    num_worker_threads: int = -1
    poll_cq_mode: PollCqMode = PollCqMode.POLLING
    enable_notification: bool = True
    notif_per_qp: int = 1024
    enable_transfer_chunking: bool = False
    chunk_bytes: int = 65536
    max_chunks_per_transfer: int = 64
    num_nics_per_transfer: int = 1


@dataclass
class XgmiBackendConfig:
    num_streams: int = 64
    num_events: int = 64


@dataclass(frozen=True)
class EngineDesc:
    key: str
    node_id: str
    hostname: str
    host: str
    port: int
    pid: int = 0

    def pack(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @staticmethod
    def unpack(data: bytes) -> EngineDesc:
        return EngineDesc(**json.loads(data))


@dataclass(frozen=True)
class MemoryDesc:
    engine_key: str = ""
    id: int = 0
    device_id: int = -1
    device_bus_id: str = ""
    numa_node: int = -1
    data: int = 0
    size: int = 0
    loc: MemoryLocationType = MemoryLocationType.Unknown
    ipc_handle: bytes = bytes(64)

    def pack(self) -> bytes:
        fields = asdict(self)
        fields["loc"] = int(self.loc)
        fields["ipc_handle"] = self.ipc_handle.hex()
        return json.dumps(fields).encode()

    @staticmethod
    def unpack(data: bytes) -> MemoryDesc:
        fields = json.loads(data)
        fields["loc"] = MemoryLocationType(fields["loc"])
        fields["ipc_handle"] = bytes.fromhex(fields["ipc_handle"])
        return MemoryDesc(**fields)


Outcome = tuple[int, str]
"""(status code, message) a completion ends with."""


@dataclass
class _Pending:
    run: Callable[[], Outcome]
    polls_left: int


class TransferStatus:
    """One operation's status; the fake's completion runs when polled, waited on, or on a thread."""

    def __init__(self) -> None:
        self._code: int = StatusCode.INIT
        self._message = ""
        self._cond = threading.Condition()
        self._pending: _Pending | None = None

    def Code(self) -> int:
        self._progress(drive=False)
        with self._cond:
            return self._code

    def Message(self) -> str:
        with self._cond:
            return self._message

    def Update(self, code: int, message: str) -> None:
        with self._cond:
            if self._code > ERR_BEGIN:
                return  # like mori: the first error sticks
            self._code, self._message = code, message
            self._cond.notify_all()

    def Init(self) -> bool:
        return self.Code() == StatusCode.INIT

    def InProgress(self) -> bool:
        return self.Code() == StatusCode.IN_PROGRESS

    def Succeeded(self) -> bool:
        return self.Code() == StatusCode.SUCCESS

    def Failed(self) -> bool:
        return self.Code() > ERR_BEGIN

    def SetCode(self, code: int) -> None:
        with self._cond:
            self._code = code
            self._cond.notify_all()

    def SetMessage(self, message: str) -> None:
        with self._cond:
            self._message = message

    def Wait(self) -> None:
        self.WaitFor(-1)

    def WaitFor(self, timeout_ms: int = -1) -> int:
        """timeout_ms < 0 waits for ever, 0 polls once, > 0 waits up to that long; may return IN_PROGRESS."""
        self._progress(drive=timeout_ms != 0)
        with self._cond:
            if timeout_ms != 0:
                self._cond.wait_for(
                    lambda: self._code != StatusCode.IN_PROGRESS, None if timeout_ms < 0 else timeout_ms / 1000
                )
            return self._code

    def _start(self, run: Callable[[], Outcome], polls: int, *, background: bool) -> None:
        self.SetCode(StatusCode.IN_PROGRESS)
        if background:
            threading.Thread(target=self._complete_on_thread, args=(run,), name="fake-mori-cq", daemon=True).start()
        else:
            self._pending = _Pending(run, polls)

    def _complete_on_thread(self, run: Callable[[], Outcome]) -> None:
        if not faults.gate.wait(GATE_TIMEOUT_S):
            self.Update(StatusCode.ERR_BAD_STATE, "fake mori: held completion never released")
            return
        self.Update(*run())

    def _progress(self, *, drive: bool) -> None:
        """Poll-driven completion, like mori's progress callback: a wait completes at once, a poll counts down."""
        with self._cond:
            pending = self._pending
            if pending is None:
                return
            if not drive and pending.polls_left > 0:
                pending.polls_left -= 1
                return
            self._pending = None
        self.Update(*pending.run())


@dataclass
class _Failure:
    code: int
    message: str
    on_completion: bool


class FaultInjector:
    """Test knobs, process-global like the registry: failures for the next batches and how batches complete."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._failures: deque[_Failure] = deque()
        self.in_progress_polls = 1
        """Polls (Code/Succeeded/Failed...) that still see IN_PROGRESS before a batch completes; a wait completes it."""
        self.background = False
        self.gate = threading.Event()
        self.gate.set()

    def fail_next(
        self,
        count: int = 1,
        code: int = StatusCode.ERR_RDMA_OP,
        message: str | None = None,
        *,
        on_completion: bool = False,
    ) -> None:
        """The next `count` transfers fail with this code and message (default: mori's SQ-full).

        At submission (status failed before batch_* returns, as mori reports a full send
        queue) or, with on_completion, after being in progress (like an RDMA completion error).
        """
        failure = _Failure(code, sq_full_message() if message is None else message, on_completion)
        with self._lock:
            self._failures.extend(failure for _ in range(count))

    def hold_completions(self) -> None:
        """From now on batches complete on a background thread, and only once `release_completions` is called."""
        self.background = True
        self.gate.clear()

    def release_completions(self) -> None:
        self.gate.set()

    def reset(self) -> None:
        with self._lock:
            self._failures.clear()
        self.in_progress_polls = 1
        self.background = False
        self.gate.set()

    def _take(self) -> _Failure | None:
        with self._lock:
            return self._failures.popleft() if self._failures else None


faults = FaultInjector()

_engines: weakref.WeakValueDictionary[str, IOEngine] = weakref.WeakValueDictionary()
_engines_lock = threading.Lock()


class IOEngineSession:
    """A (local memory, remote memory) pair, as `IOEngine.create_session` returns it."""

    def __init__(self, engine: IOEngine, local: MemoryDesc, remote: MemoryDesc) -> None:
        self._engine = engine
        self._local = local
        self._remote = remote

    def allocate_transfer_uid(self) -> int:
        return self._engine.allocate_transfer_uid()

    def read(self, local_offset: int, remote_offset: int, size: int, transfer_uid: int) -> TransferStatus:
        return self.batch_read([local_offset], [remote_offset], [size], transfer_uid)

    def write(self, local_offset: int, remote_offset: int, size: int, transfer_uid: int) -> TransferStatus:
        return self.batch_write([local_offset], [remote_offset], [size], transfer_uid)

    def batch_read(
        self, local_offsets: Sequence[int], remote_offsets: Sequence[int], sizes: Sequence[int], transfer_uid: int
    ) -> TransferStatus:
        return self._engine._transfer(self._local, local_offsets, self._remote, remote_offsets, sizes, into_local=True)

    def batch_write(
        self, local_offsets: Sequence[int], remote_offsets: Sequence[int], sizes: Sequence[int], transfer_uid: int
    ) -> TransferStatus:
        return self._engine._transfer(self._local, local_offsets, self._remote, remote_offsets, sizes, into_local=False)

    def alive(self) -> bool:
        return _engines.get(self._remote.engine_key) is not None


class IOEngine:
    def __init__(self, key: str, config: IOEngineConfig) -> None:
        self._key = key
        self._desc = EngineDesc(key, "fake-node", socket.gethostname(), config.host, config.port, os.getpid())
        self._backends: dict[BackendType, object] = {}
        self._remotes: dict[str, EngineDesc] = {}
        self._memory: dict[int, MemoryDesc] = {}
        self._memory_ids = itertools.count()
        self._transfer_ids = itertools.count()
        with _engines_lock:
            if _engines.get(key) is not None:
                raise RuntimeError(f"fake mori: engine key {key!r} is already in use in this process")
            _engines[key] = self

    def get_engine_desc(self) -> EngineDesc:
        return self._desc

    def create_backend(self, type: BackendType, config: object | None = None) -> None:
        if type is BackendType.RDMA:
            self._backends[type] = config if config is not None else RdmaBackendConfig()
        elif type is BackendType.XGMI:
            self._backends[type] = config if config is not None else XgmiBackendConfig()
        else:
            raise NotImplementedError("backend not implemented yet")

    def remove_backend(self, type: BackendType) -> None:
        self._backends.pop(type, None)

    def register_remote_engine(self, engine_desc: EngineDesc) -> None:
        self._remotes[engine_desc.key] = engine_desc

    def deregister_remote_engine(self, engine_desc: EngineDesc) -> None:
        self._remotes.pop(engine_desc.key, None)

    def register_memory(self, ptr: int, size: int, device_id: int, mem_loc: MemoryLocationType) -> MemoryDesc:
        if mem_loc != MemoryLocationType.CPU:
            raise RuntimeError("the fake mori.io moves host (CPU) memory only")
        desc = MemoryDesc(self._key, next(self._memory_ids), device_id, "", -1, ptr, size, MemoryLocationType(mem_loc))
        self._memory[desc.id] = desc
        return desc

    def register_torch_tensor(self, tensor: Any) -> MemoryDesc:
        if not tensor.is_contiguous():
            raise RuntimeError("input tensor must be contiguous")
        locations = {"cpu": MemoryLocationType.CPU, "cuda": MemoryLocationType.GPU}
        device_id = tensor.device.index if tensor.device.index is not None else -1
        size = tensor.nelement() * tensor.element_size()
        return self.register_memory(tensor.data_ptr(), size, device_id, locations[tensor.device.type])

    def deregister_memory(self, mem_desc: MemoryDesc) -> None:
        self._memory.pop(mem_desc.id, None)

    def allocate_transfer_uid(self) -> int:
        return next(self._transfer_ids)

    def read(
        self, local: MemoryDesc, local_offset: int, remote: MemoryDesc, remote_offset: int, size: int, uid: int
    ) -> TransferStatus:
        return self._transfer(local, [local_offset], remote, [remote_offset], [size], into_local=True)

    def write(
        self, local: MemoryDesc, local_offset: int, remote: MemoryDesc, remote_offset: int, size: int, uid: int
    ) -> TransferStatus:
        return self._transfer(local, [local_offset], remote, [remote_offset], [size], into_local=False)

    def batch_read(
        self,
        local_descs: Sequence[MemoryDesc],
        local_offsets: Sequence[Sequence[int]],
        remote_descs: Sequence[MemoryDesc],
        remote_offsets: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        uids: Sequence[int],
    ) -> list[TransferStatus]:
        """One status per (local, remote) pair, like the real engine-level batch."""
        pairs = zip(local_descs, local_offsets, remote_descs, remote_offsets, sizes, strict=True)
        return [self._transfer(ld, lo, rd, ro, sz, into_local=True) for ld, lo, rd, ro, sz in pairs]

    def batch_write(
        self,
        local_descs: Sequence[MemoryDesc],
        local_offsets: Sequence[Sequence[int]],
        remote_descs: Sequence[MemoryDesc],
        remote_offsets: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        uids: Sequence[int],
    ) -> list[TransferStatus]:
        pairs = zip(local_descs, local_offsets, remote_descs, remote_offsets, sizes, strict=True)
        return [self._transfer(ld, lo, rd, ro, sz, into_local=False) for ld, lo, rd, ro, sz in pairs]

    def create_session(self, local_mem: MemoryDesc, remote_mem: MemoryDesc) -> IOEngineSession | None:
        """None where no backend can reach the pair (mori: no backend created, unknown remote engine)."""
        if not self._backends or local_mem.id not in self._memory or remote_mem.engine_key not in self._remotes:
            return None
        return IOEngineSession(self, local_mem, remote_mem)

    def pop_inbound_transfer_status(self, remote_key: str, transfer_uid: int) -> TransferStatus | None:
        return None  # inbound notifications are not modelled (MoRIIO turns them off)

    def wait_all(self, statuses: Sequence[TransferStatus], timeout_ms: int = -1) -> int:
        """SUCCESS, the first failure code, or IN_PROGRESS when the timeout ran out first."""
        first_error: int = StatusCode.SUCCESS
        for status in statuses:
            code = status.WaitFor(timeout_ms)
            if code == StatusCode.IN_PROGRESS:
                return first_error if first_error != StatusCode.SUCCESS else code
            if code != StatusCode.SUCCESS and first_error == StatusCode.SUCCESS:
                first_error = code
        return first_error

    def _transfer(
        self,
        local: MemoryDesc,
        local_offsets: Sequence[int],
        remote: MemoryDesc,
        remote_offsets: Sequence[int],
        sizes: Sequence[int],
        *,
        into_local: bool,
    ) -> TransferStatus:
        status = TransferStatus()
        if not self._backends:
            status.Update(StatusCode.ERR_BAD_STATE, "No available backend found, create backend first")
            return status
        failure = faults._take()
        if failure is not None and not failure.on_completion:
            status.Update(failure.code, failure.message)
            return status
        ops = list(zip(local_offsets, remote_offsets, sizes, strict=True))
        problem = self._check(local, remote, ops)
        if problem is not None:
            status.Update(*problem)
            return status

        def run() -> Outcome:
            peer = _engines.get(remote.engine_key)
            if peer is None or peer._memory.get(remote.id) != remote or self._memory.get(local.id) != local:
                return StatusCode.ERR_RDMA_OP, "fake mori: memory deregistered while the transfer was in flight"
            if failure is not None:
                return failure.code, failure.message
            for local_offset, remote_offset, size in ops:
                local_address, remote_address = local.data + local_offset, remote.data + remote_offset
                if into_local:
                    ctypes.memmove(local_address, remote_address, size)
                else:
                    ctypes.memmove(remote_address, local_address, size)
            return StatusCode.SUCCESS, ""

        status._start(run, faults.in_progress_polls, background=faults.background)
        return status

    def _check(self, local: MemoryDesc, remote: MemoryDesc, ops: list[tuple[int, int, int]]) -> Outcome | None:
        if self._memory.get(local.id) != local:
            return StatusCode.ERR_NOT_FOUND, f"local memory {local.id} is not registered with {self._key!r}"
        if remote.engine_key not in self._remotes:
            return StatusCode.ERR_NOT_FOUND, f"remote engine {remote.engine_key!r} is not registered"
        for local_offset, remote_offset, size in ops:
            if size < 0 or local_offset < 0 or remote_offset < 0:
                return StatusCode.ERR_INVALID_ARGS, "negative offset or size"
            if local_offset + size > local.size or remote_offset + size > remote.size:
                return StatusCode.ERR_INVALID_ARGS, "length out of range"
        return None
