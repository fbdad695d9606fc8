"""The transport contract: register KV tensors, read/write batches of (local, remote, size), poll a status.

Shaped so that a mori.io IOEngine fits behind it: `register` is
`register_torch_tensor` (its packed MemoryDesc travels in `RegionDescriptor.extra`),
`connect` is `create_session`, `read`/`write` are `batch_read`/`batch_write`
returning a status with succeeded / failed / in progress, a code and a message,
and `wait_all` is `wait_all`. A failure is transient (send queue full: retry with
backoff) or terminal; the caller decides what to do, the transport never retries.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum, StrEnum
from typing import Any, Protocol, TypeAlias

import msgspec

Op: TypeAlias = tuple[int, int, int]
"""(local offset, remote offset, size) in bytes, offsets from the start of each side's region."""


class TransportEndpoint(msgspec.Struct, frozen=True, kw_only=True):
    """Where a transport listens, as a peer learns it in the handshake."""

    backend: str
    host: str
    port: int
    extra: bytes = b""
    generation: int = 0
    """The serving rank's generation (`connector/generation.py`); 0: none. A tcp request names the one its
    session was connected to, and a server of another life refuses it (PEER_RESTARTED)."""


class RegionDescriptor(msgspec.Struct, frozen=True, kw_only=True):
    """A registered memory region (one layer's KV tensor) as a peer addresses it."""

    name: str
    size: int
    extra: bytes = b""


class State(StrEnum):
    IN_PROGRESS = "in_progress"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


class Code(IntEnum):
    OK = 0
    SEND_QUEUE_FULL = 1
    """Transient back-pressure (mori's "SQ full"): retry within the transfer timeout."""
    PEER_UNREACHABLE = 2
    BAD_REQUEST = 3
    """Offsets outside a region, unknown region, too many ops: a bug, never retried."""
    REMOTE_ERROR = 4
    CLOSED = 5
    TIMEOUT = 6
    REFUSED = 7
    """The producer no longer holds the transfer the read named (released or expired): its blocks may hold
    another request's KV, so no byte of them was sent. Terminal: the consumer reports a load error."""
    NOT_HELD_YET = 8
    """The producer rank has not mapped the transfer yet (its metadata comes with its next step): transient."""
    PEER_RESTARTED = 9
    """The peer on the session's address is another life (another generation) than the one the session was
    connected to: it restarted, maybe with another layout, so no byte was moved. Terminal; the link must be
    handshaken again."""


PEER_GONE: frozenset[Code] = frozenset({Code.PEER_UNREACHABLE, Code.TIMEOUT, Code.PEER_RESTARTED})
"""Failures that mean the peer the session was made with is gone (unreachable, silent past the request's
deadline, or restarted): the worker forgets that link, so the next transfer handshakes again."""


@dataclass(frozen=True)
class TransferStatus:
    state: State
    code: Code = Code.OK
    message: str = ""
    transient: bool = False

    def succeeded(self) -> bool:
        return self.state is State.SUCCEEDED

    def failed(self) -> bool:
        return self.state is State.FAILED

    def in_progress(self) -> bool:
        return self.state is State.IN_PROGRESS


IN_PROGRESS = TransferStatus(State.IN_PROGRESS)
SUCCEEDED = TransferStatus(State.SUCCEEDED)


def failed(code: Code, message: str, *, transient: bool = False) -> TransferStatus:
    return TransferStatus(State.FAILED, code, message, transient)


def check_ops(
    local: str,
    local_size: int | None,
    remote: str,
    descriptor: RegionDescriptor | None,
    ops: Sequence[Op],
    *,
    ops_max: int,
    op_bytes_max: int | None = None,
) -> TransferStatus | None:
    """The checks every transport makes before a batch (a bug, never retried): the failure, or None."""
    if local_size is None:
        return failed(Code.BAD_REQUEST, f"no local region {local!r}")
    if descriptor is None:
        return failed(Code.BAD_REQUEST, f"peer has no region {remote!r}")
    if len(ops) > ops_max:
        return failed(Code.BAD_REQUEST, f"{len(ops)} ops > {ops_max}")
    for lo, ro, size in ops:
        if op_bytes_max is not None and size > op_bytes_max:
            return failed(Code.BAD_REQUEST, f"op of {size} bytes > {op_bytes_max}")
        if lo < 0 or ro < 0 or size < 0 or lo + size > local_size or ro + size > descriptor.size:
            return failed(Code.BAD_REQUEST, f"op ({lo}, {ro}, {size}) outside {local!r}/{remote!r}")
    return None


class TransferHandle:
    """The status of one batch, set once by the transport's thread; safe to poll from any thread."""

    __slots__ = ("_done", "_status")

    def __init__(self, status: TransferStatus = IN_PROGRESS) -> None:
        self._status = status
        self._done = threading.Event()
        if not status.in_progress():
            self._done.set()

    def status(self) -> TransferStatus:
        return self._status

    def finish(self, status: TransferStatus) -> None:
        assert not status.in_progress()
        if self._done.is_set():
            return  # first outcome wins: a late reply after close does not flip a status
        self._status = status
        self._done.set()

    def wait(self, timeout_s: float) -> bool:
        return self._done.wait(timeout_s)

    def cancel(self) -> None:
        """The caller gives up on this batch (its transfer was decided): it fails now, and a transport that
        keeps per-request state (tcp) frees it and drops whatever the peer answers later."""
        self.finish(failed(Code.CLOSED, "given up by the caller"))


HoldCheck: TypeAlias = Callable[[str], bool | None]
"""Whether this process holds the named transfer's blocks: True held, False let go (for good), None not known
here yet. Safe to call from any thread."""


class Session(Protocol):
    endpoint: TransportEndpoint


class Transport(Protocol):
    """One engine rank's transport; methods are called from one thread (the worker's)."""

    backend: str

    @property
    def one_sided(self) -> bool:
        """True where the producer never sees a read (RDMA): it cannot refuse one, so the consumer confirms."""
        ...

    def register(self, name: str, tensor: Any) -> RegionDescriptor:
        """Make a KV tensor readable and writable by peers under `name`."""
        ...

    def endpoint(self) -> TransportEndpoint: ...

    def connect(self, endpoint: TransportEndpoint, regions: Sequence[RegionDescriptor]) -> Session:
        """A session with a peer whose regions were learnt in a completed handshake."""
        ...

    def read(
        self, session: Session, local: str, remote: str, ops: Sequence[Op], *, transfer_id: str = ""
    ) -> TransferHandle:
        """Copy remote region bytes into the local region, op by op; returns at once. `transfer_id` names the
        transfer the bytes belong to: a peer that serves reads refuses one for a transfer it no longer holds."""
        ...

    def set_hold_check(self, held: HoldCheck | None) -> None:
        """Serve a peer's read only while `held(transfer_id)` is True, checked before the bytes are copied and
        again after (False: refused, REFUSED; None: refused for now, NOT_HELD_YET, transient). A hold is never
        taken back once let go, so True after the copy means the blocks were held throughout it. Called from
        the transport's own threads. A one-sided transport (mori) cannot refuse a read: there the consumer
        confirms with the producer instead."""
        ...

    def write(self, session: Session, local: str, remote: str, ops: Sequence[Op]) -> TransferHandle:
        """Copy local region bytes into the remote region; returns at once."""
        ...

    def wait_all(self, handles: Sequence[TransferHandle], timeout_s: float) -> bool:
        """True when every handle finished within the timeout."""
        ...

    def close(self) -> None: ...
