"""The tcp transport: real tensor bytes between processes over pyzmq (ROUTER server, DEALER clients).

Two threads per transport: a server that answers peers' reads (sending views
of the registered tensors, zero-copy on CPU) and applies their writes, and a
client I/O thread that owns every outgoing socket, sends queued batches and
completes handles from the replies. The caller's thread only queues work and
wakes the client through a pipe, so `read`/`write` never block on the network.
A device region's bytes go through host staging (staging.py): one gather, one copy and one sync per
request, done on the I/O threads (never the caller's), with the next request staged while zmq sends the last.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch
import zmq

from kvledger.connector.limits import (
    CHANNEL_POLL_MS,
    STOP_JOIN_TIMEOUT_S,
    TRANSPORT_FRAME_BYTES_MAX,
    TRANSPORT_INFLIGHT_MAX,
    TRANSPORT_INFLIGHT_PER_PEER_MAX,
    TRANSPORT_OPS_PER_REQUEST_MAX,
    TRANSPORT_REQUEST_TIMEOUT_S,
    TRANSPORT_STAGING_BYTES,
    TRANSPORT_SWEEP_S,
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
from kvledger.connector.transports.regions import RegionError, TensorRegion
from kvledger.connector.transports.staging import Staging, StagingCounts, ready_marker

log = logging.getLogger(__name__)

BACKEND = "tcp"

_NOT_HELD = "transfer not held by the producer (released or expired): no bytes sent"
_RESTARTED = "the peer restarted since the handshake (generation {} asked, {} here): no bytes moved"


class _Request(msgspec.Struct, array_like=True):
    id: int
    op: str  # "read" or "write"
    region: str
    spans: list[tuple[int, int]]  # (remote offset, size)
    transfer: str = ""
    """The transfer a read is for: a server with a hold check serves it only while that transfer is held."""
    generation: int = 0
    """The server's life the session was connected to (its endpoint's generation); 0: none named. A server of
    another life answers PEER_RESTARTED: its regions may have another layout than the one the client read."""


class _Reply(msgspec.Struct, array_like=True):
    id: int
    code: int
    message: str = ""


_req_encoder = msgspec.msgpack.Encoder()
_req_decoder = msgspec.msgpack.Decoder(_Request)
_reply_decoder = msgspec.msgpack.Decoder(_Reply)


@dataclass
class TcpSession:
    endpoint: TransportEndpoint
    regions: dict[str, RegionDescriptor] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"tcp://{self.endpoint.host}:{self.endpoint.port}"


@dataclass
class _Job:
    url: str
    request_id: int
    frames: list[Any]
    handle: TransferHandle
    read_into: tuple[TensorRegion, list[Op]] | None
    deadline: float
    """Monotonic: past it the request fails (TIMEOUT) and its slot is freed, answered or not."""
    stage_from: tuple[TensorRegion, list[Op]] | None = None
    """A staged region's write: its payload is gathered on the client thread, just before it is sent."""
    ready: Any = None
    """staging.ready_marker at submission: the transport's stream waits for the caller's work on the region."""


class TcpTransport:
    """See the module docstring. `port=0` picks a free port (tests)."""

    backend = BACKEND
    one_sided = False
    """The producer serves each read, so it refuses one for a transfer it no longer holds."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        context: zmq.Context[Any] | None = None,
        staging_bytes: int = TRANSPORT_STAGING_BYTES,
        stage_host_regions: bool = False,
        request_timeout_s: float = TRANSPORT_REQUEST_TIMEOUT_S,
        generation: int = 0,
        inflight_max: int = TRANSPORT_INFLIGHT_MAX,
        inflight_per_peer_max: int = TRANSPORT_INFLIGHT_PER_PEER_MAX,
    ) -> None:
        """`staging_bytes`: the size of each staging buffer (limits.TRANSPORT_STAGING_BYTES says why).
        `generation`: this rank's life (`connector/generation.py`), published in the endpoint; requests naming
        another are refused. `stage_host_regions`: move CPU regions through the staging path too, as device
        regions are (tests and the benchmark run the device path's gather and scatter on CPU tensors with it).
        `inflight_max`, `inflight_per_peer_max`: the bounds on requests outstanding, in total and to one peer
        (the limits' by default; the simulator scales them to its storms)."""
        self._own_context = context is None
        self._stage_host_regions = stage_host_regions
        self._client_staging = Staging(staging_bytes)
        self._server_staging = Staging(staging_bytes)
        """One per I/O thread (client, server): each is used by its thread only."""
        self._context: zmq.Context[Any] = context if context is not None else zmq.Context()
        self._regions: dict[str, TensorRegion] = {}
        self._hold_check: HoldCheck | None = None
        """Set by the worker of a producer: reads are served only for transfers it holds."""
        self._ids = itertools.count(1)
        self._stop = threading.Event()
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._wake_read, self._wake_write = os.pipe()
        self.request_timeout_s = request_timeout_s
        """Every request's deadline from its submission (the worker gives its transfer timeout)."""
        self._slots = _Slots(inflight_max, inflight_per_peer_max)
        server = self._context.socket(zmq.ROUTER)
        server.setsockopt(zmq.LINGER, 0)
        if port == 0:
            port = server.bind_to_random_port(f"tcp://{host}")
        else:
            server.bind(f"tcp://{host}:{port}")
        self._generation = generation
        self._endpoint = TransportEndpoint(backend=BACKEND, host=host, port=port, generation=generation)
        self._server_thread = threading.Thread(
            target=self._serve, args=(server,), name=f"kvledger-tcp-server-{port}", daemon=True
        )
        self._client_thread = threading.Thread(
            target=self._client_loop, name=f"kvledger-tcp-client-{port}", daemon=True
        )
        self._server_thread.start()
        self._client_thread.start()

    # -- the contract ---------------------------------------------------------

    def register(self, name: str, tensor: torch.Tensor) -> RegionDescriptor:
        region = TensorRegion(tensor, staged=True if self._stage_host_regions else None)
        self._regions[name] = region
        return RegionDescriptor(name=name, size=region.size)

    def endpoint(self) -> TransportEndpoint:
        return self._endpoint

    def staging_counts(self) -> StagingCounts:
        """What both I/O threads' staging did (copies, gathers, scatters, syncs); read after the work settled."""
        return self._client_staging.counts.add(self._server_staging.counts)

    def connect(self, endpoint: TransportEndpoint, regions: Sequence[RegionDescriptor]) -> TcpSession:
        if endpoint.backend != BACKEND:
            raise ValueError(f"a tcp transport cannot talk to a {endpoint.backend!r} endpoint")
        return TcpSession(endpoint, {r.name: r for r in regions})

    def read(
        self, session: Any, local: str, remote: str, ops: Sequence[Op], *, transfer_id: str = ""
    ) -> TransferHandle:
        return self._submit(session, "read", local, remote, ops, transfer_id)

    def set_hold_check(self, held: HoldCheck | None) -> None:
        self._hold_check = held

    def write(self, session: Any, local: str, remote: str, ops: Sequence[Op]) -> TransferHandle:
        return self._submit(session, "write", local, remote, ops)

    def wait_all(self, handles: Sequence[TransferHandle], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        return all(h.wait(max(0.0, deadline - time.monotonic())) for h in handles)

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        os.write(self._wake_write, b"x")
        self._server_thread.join(STOP_JOIN_TIMEOUT_S)
        self._client_thread.join(STOP_JOIN_TIMEOUT_S)
        while True:  # whatever was queued but never sent fails, so no caller waits on it forever
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            job.handle.finish(failed(Code.CLOSED, "transport closed"))
        os.close(self._wake_read)
        os.close(self._wake_write)
        if self._own_context:
            self._context.term()

    # -- the caller's side ----------------------------------------------------

    def _submit(
        self, session: Any, op: str, local: str, remote: str, ops: Sequence[Op], transfer_id: str = ""
    ) -> TransferHandle:
        if self._stop.is_set():
            return TransferHandle(failed(Code.CLOSED, "transport closed"))
        checked = self._check(session, local, remote, ops)
        if isinstance(checked, TransferStatus):
            return TransferHandle(checked)
        region = checked
        url = session.url
        refused = self._slots.take(url)
        if refused is not None:
            # Back-pressure is transient, like mori's send queue full: the caller retries later.
            return TransferHandle(failed(Code.SEND_QUEUE_FULL, refused, transient=True))
        op_list = list(ops)
        spans = [(ro, size) for _, ro, size in op_list]
        request = _Request(next(self._ids), op, remote, spans, transfer_id, session.endpoint.generation)
        frames: list[Any] = [_req_encoder.encode(request)]
        ready = ready_marker(region) if region.staged else None
        if op == "write" and not region.staged:
            try:
                frames.extend(region.view(lo, size) for lo, _, size in op_list)
            except RegionError as error:
                self._slots.give(url)
                return TransferHandle(failed(Code.BAD_REQUEST, str(error)))
        handle = TransferHandle()
        read_into = (region, op_list) if op == "read" else None
        stage_from = (region, op_list) if op == "write" and region.staged else None
        deadline = time.monotonic() + self.request_timeout_s
        self._jobs.put(_Job(url, request.id, frames, handle, read_into, deadline, stage_from, ready))
        os.write(self._wake_write, b"x")
        return handle

    def _check(self, session: Any, local: str, remote: str, ops: Sequence[Op]) -> TensorRegion | TransferStatus:
        region = self._regions.get(local)
        problem = check_ops(
            local, region.size if region else None, remote, session.regions.get(remote), ops,
            ops_max=TRANSPORT_OPS_PER_REQUEST_MAX, op_bytes_max=TRANSPORT_FRAME_BYTES_MAX,
        )  # fmt: skip
        if problem is not None:
            return problem
        assert region is not None
        return region

    def inflight(self, url: str | None = None) -> int:
        """Requests holding a slot (to `url`'s peer, or to all): submitted, neither answered nor given up."""
        return self._slots.count(url)

    # -- the client I/O thread -----------------------------------------------

    def _client_loop(self) -> None:
        sockets: dict[str, zmq.Socket[Any]] = {}
        pending: dict[int, _Job] = {}
        poller = zmq.Poller()
        poller.register(self._wake_read, zmq.POLLIN)
        swept_at = time.monotonic()
        try:
            while not self._stop.is_set():
                if time.monotonic() - swept_at >= TRANSPORT_SWEEP_S:
                    swept_at = time.monotonic()
                    self._sweep(pending, swept_at)
                for sock_or_fd, _ in poller.poll(CHANNEL_POLL_MS):
                    if sock_or_fd == self._wake_read:
                        os.read(self._wake_read, 4096)
                        continue
                    assert isinstance(sock_or_fd, zmq.Socket)
                    self._on_reply(sock_or_fd, pending)
                while True:
                    try:
                        job = self._jobs.get_nowait()
                    except queue.Empty:
                        break
                    sock = sockets.get(job.url)
                    if sock is None:
                        sock = sockets[job.url] = self._context.socket(zmq.DEALER)
                        sock.setsockopt(zmq.LINGER, 0)
                        sock.connect(job.url)
                        poller.register(sock, zmq.POLLIN)
                    if job.stage_from is not None and not self._stage_write(job):
                        continue
                    pending[job.request_id] = job
                    sock.send_multipart(job.frames, copy=False)
        except zmq.ZMQError as error:  # the context was torn down under us
            log.warning("tcp transport client stopped: %s", error)
        finally:
            for job in pending.values():
                self._slots.give(job.url)
                job.handle.finish(failed(Code.CLOSED, "transport closed"))
            for sock in sockets.values():
                sock.close(linger=0)

    def _stage_write(self, job: _Job) -> bool:
        """Gather a staged write's payload into its frames (on this thread, so the caller never waits for the
        device); False, with the job failed, where the device refused."""
        assert job.stage_from is not None
        region, ops = job.stage_from
        try:
            job.frames.extend(self._client_staging.gather(region, [(lo, size) for lo, _, size in ops], job.ready))
        except (RuntimeError, RegionError) as error:  # a device error (out of memory, a lost device)
            self._slots.give(job.url)
            job.handle.finish(failed(Code.BAD_REQUEST, f"staging the write failed: {error}"))
            return False
        return True

    def _on_reply(self, sock: zmq.Socket[Any], pending: dict[int, _Job]) -> None:
        """Take one reply; a read's payload is received straight into the local region (one copy)."""
        header = sock.recv()
        try:
            reply = _reply_decoder.decode(header)
        except (msgspec.DecodeError, msgspec.ValidationError) as error:
            log.warning("tcp transport: malformed reply dropped: %s", error)
            self._drain(sock)
            return
        job = pending.pop(reply.id, None)
        if job is None:
            self._drain(sock)  # past its deadline, or given up: the reply (and a read's bytes) is dropped
            return
        self._slots.give(job.url)
        if not job.handle.status().in_progress():
            self._drain(sock)  # given up since the last sweep: its blocks may be another request's by now
            return
        if reply.code != Code.OK:
            self._drain(sock)
            transient = reply.code in (Code.SEND_QUEUE_FULL, Code.NOT_HELD_YET)
            job.handle.finish(failed(Code(reply.code), reply.message, transient=transient))
            return
        if job.read_into is None:
            self._drain(sock)
            job.handle.finish(SUCCEEDED)
            return
        region, ops = job.read_into
        inbound = self._client_staging.inbound(region, job.ready) if region.staged else None
        try:
            for lo, _, size in ops:
                if not sock.getsockopt(zmq.RCVMORE):
                    raise RegionError(f"reply ended before {len(ops)} ops")
                if inbound is None:
                    target = region.writable(lo, size)
                    assert target is not None, "an unstaged region is on the host"
                    received = sock.recv_into(target)
                else:
                    frame = sock.recv(copy=False)
                    received = len(frame)
                    if received == size:
                        inbound.put(lo, frame.buffer)
                if received != size:
                    raise RegionError(f"frame of {received} bytes for an op of {size}")
            if sock.getsockopt(zmq.RCVMORE):
                raise RegionError(f"more frames than {len(ops)} ops")
            if inbound is not None:
                inbound.finish()
        except (RuntimeError, RegionError) as error:  # RuntimeError: the device refused the staged copy
            self._drain(sock)
            job.handle.finish(failed(Code.REMOTE_ERROR, str(error)))
            return
        job.handle.finish(SUCCEEDED)

    def _sweep(self, pending: dict[int, _Job], now: float) -> None:
        """Free the slot of every request past its deadline (its handle fails, TIMEOUT) or given up by its
        caller (`TransferHandle.cancel`); a reply that comes after is dropped (`_on_reply`)."""
        over = [i for i, job in pending.items() if now >= job.deadline or not job.handle.status().in_progress()]
        for request_id in over:
            job = pending.pop(request_id)
            self._slots.give(job.url)
            job.handle.finish(failed(Code.TIMEOUT, f"no reply within {self.request_timeout_s:g} s"))

    @staticmethod
    def _drain(sock: zmq.Socket[Any]) -> None:
        while sock.getsockopt(zmq.RCVMORE):
            sock.recv(copy=False)

    # -- the server thread ----------------------------------------------------

    def _serve(self, server: zmq.Socket[Any]) -> None:
        poller = zmq.Poller()
        poller.register(server, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(CHANNEL_POLL_MS):
                    continue
                frames = server.recv_multipart(copy=False)
                server.send_multipart(self._answer(frames), copy=False)
        except zmq.ZMQError as error:
            log.warning("tcp transport server stopped: %s", error)
        finally:
            server.close(linger=0)

    def _answer(self, frames: list[Any]) -> list[Any]:
        """One request's reply frames. A staged region is touched here with no ready event (ready_marker): one
        recorded on this thread would mark this thread's stream, on which vLLM runs no kernel (it computes on
        a stream of its own), so it would order nothing. The protocol orders it: a read comes for a request the
        producer's vLLM has finished (and is served only while held, where holds are checked), so the step that
        wrote its KV had its output copied to the host (synchronised with that forward) before anyone could ask;
        a write lands in blocks allocated to a request waiting for it, untouched by vLLM's kernels until the
        receive is reported, which is after `Inbound.finish` synchronised the copy."""
        identity = frames[0]
        if len(frames) < 2:
            return [identity, msgspec.msgpack.encode(_Reply(0, Code.BAD_REQUEST, "no header"))]
        try:
            request = _req_decoder.decode(frames[1].buffer)
        except (msgspec.DecodeError, msgspec.ValidationError) as error:
            return [identity, msgspec.msgpack.encode(_Reply(0, Code.BAD_REQUEST, f"bad header: {error}"))]
        if request.generation and request.generation != self._generation:
            # Checked before anything else: the client's offsets and sizes are another life's layout.
            message = _RESTARTED.format(request.generation, self._generation)
            return [identity, msgspec.msgpack.encode(_Reply(request.id, Code.PEER_RESTARTED, message))]
        region = self._regions.get(request.region)
        if region is None:
            return [
                identity,
                msgspec.msgpack.encode(_Reply(request.id, Code.BAD_REQUEST, f"no region {request.region!r}")),
            ]
        try:
            if request.op == "read":
                held = self._hold_check
                if held is None:
                    views = self._read_frames(region, request.spans, copy=False)
                    return [identity, msgspec.msgpack.encode(_Reply(request.id, Code.OK)), *views]
                # Checked before a byte is copied and again after: holds are never taken back, so a side held
                # after the copy was held throughout it, and the copy (not the tensor, which vLLM may reuse
                # once the hold ends) is what goes on the wire.
                answer = held(request.transfer) if request.transfer else False
                if answer is not True:
                    code = Code.NOT_HELD_YET if answer is None else Code.REFUSED
                    return [identity, msgspec.msgpack.encode(_Reply(request.id, code, _NOT_HELD))]
                copies = self._read_frames(region, request.spans, copy=True)
                if held(request.transfer) is not True:
                    return [identity, msgspec.msgpack.encode(_Reply(request.id, Code.REFUSED, _NOT_HELD))]
                return [identity, msgspec.msgpack.encode(_Reply(request.id, Code.OK)), *copies]
            if request.op == "write":
                payload = frames[2:]
                if len(payload) != len(request.spans):
                    raise RegionError(f"{len(payload)} frames for {len(request.spans)} ops")
                for (offset, size), frame in zip(request.spans, payload, strict=True):
                    if len(frame) != size:  # checked for every frame first: nothing is half-applied for it
                        raise RegionError(f"frame of {len(frame)} bytes for an op of {size}")
                    region.check(offset, size)
                inbound = self._server_staging.inbound(region) if region.staged else None
                for (offset, _), frame in zip(request.spans, payload, strict=True):
                    if inbound is None:
                        region.store(offset, frame.buffer)
                    else:
                        inbound.put(offset, frame.buffer)
                if inbound is not None:
                    inbound.finish()
                return [identity, msgspec.msgpack.encode(_Reply(request.id, Code.OK))]
        except (RuntimeError, RegionError) as error:  # RuntimeError: the device refused a staged copy
            return [identity, msgspec.msgpack.encode(_Reply(request.id, Code.BAD_REQUEST, str(error)))]
        return [identity, msgspec.msgpack.encode(_Reply(request.id, Code.BAD_REQUEST, f"unknown op {request.op!r}"))]

    def _read_frames(self, region: TensorRegion, spans: list[tuple[int, int]], *, copy: bool) -> list[Any]:
        """A read's reply frames: a staged region's gathered copy (one gather, one copy), else views of the
        host region (copies where `copy`: the bytes as they were when checked, whatever the tensor does next)."""
        if region.staged:
            for offset, size in spans:
                region.check(offset, size)
            return self._server_staging.gather(region, spans)
        if copy:
            return [bytes(region.view(offset, size)) for offset, size in spans]
        return [region.view(offset, size) for offset, size in spans]


class _Slots:
    """In-flight requests, bounded in total and per peer (by url), so a peer that never answers holds at most
    its own share until its requests' deadlines pass. Taken by the caller's thread, given back by the client
    I/O thread."""

    def __init__(self, total_max: int, per_peer_max: int) -> None:
        self._total_max = total_max
        self._per_peer_max = per_peer_max
        self._total = 0
        self._by_url: dict[str, int] = {}
        self._lock = threading.Lock()

    def take(self, url: str) -> str | None:
        """None if a slot was taken for `url`; else why not (the request is refused, transiently)."""
        with self._lock:
            mine = self._by_url.get(url, 0)
            if mine >= self._per_peer_max:
                return f"send queue full: {mine} requests in flight to {url}"
            if self._total >= self._total_max:
                return f"send queue full: {self._total} requests in flight"
            self._by_url[url] = mine + 1
            self._total += 1
            return None

    def give(self, url: str) -> None:
        with self._lock:
            left = self._by_url[url] - 1
            if left:
                self._by_url[url] = left
            else:
                del self._by_url[url]
            self._total -= 1

    def count(self, url: str | None) -> int:
        with self._lock:
            return self._total if url is None else self._by_url.get(url, 0)
