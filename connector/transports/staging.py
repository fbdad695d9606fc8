"""Host staging for a device region's bytes: one gather, one copy and one sync per request, not per op.

Sending (a write's payload, a served read's reply): the request's ops are gathered on the device into one
contiguous buffer by one `index_select` over the region's bytes viewed as units (the largest size dividing
every offset and size: no Python loop over ops, no per-op copy), copied once into a reusable pinned host
buffer (`non_blocking`, on the transport's own stream, never the compute stream), synchronised once, and
sent as slices of that buffer (one zmq frame per op, as a CPU region sends): zero-copy from pyzmq's copy
threshold (zmq.COPY_THRESHOLD, 64 KiB) up, copied into zmq's messages below it. Receiving: each frame
is copied once from zmq's message into a reusable pinned buffer, then the buffer goes to the device in one
copy and into the blocks in one device-side scatter (`index_copy_`).

Bounds (connector/limits.py): each I/O thread has one `_Lane` per device: a device buffer and pinned host
buffers of TRANSPORT_STAGING_BYTES each, allocated on first use. A request larger than that is staged in
chunks through them (its reply is then assembled in one host buffer of the request's size, since a zmq
multipart message is handed to the wire only once its last frame is queued). A pinned send buffer is reused
only once zmq has released every zero-copy frame of it (its MessageTracker): with TRANSPORT_STAGING_BUFFERS,
the next request (a WRITE's next layer) is staged while the previous one is on the wire.

The same code runs on CPU tensors (a region flagged `staged`): CI checks the gather, chunking and scatter
there. Only `_Lane`'s pinned allocation, `non_blocking`, stream and event handling differ on CUDA.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy
import torch
import zmq

from kvledger.connector.limits import TRANSPORT_STAGING_BUFFERS, TRANSPORT_STAGING_BYTES, TRANSPORT_STAGING_INDEX_MAX
from kvledger.connector.transports.regions import TensorRegion

Span = tuple[int, int]
"""(offset, size) in bytes of one side's region."""


@dataclass
class StagingCounts:
    """What the staging did, by kind (the copy-count tests guard one copy per request with these)."""

    gathers: int = 0
    """Device-side gathers of a chunk's ops into the device buffer (one index_select each)."""
    to_host: int = 0
    """Device-to-host copies of a gathered chunk."""
    to_device: int = 0
    """Host-to-device copies of a received chunk."""
    scatters: int = 0
    """Device-side scatters of a received chunk into the region's blocks (one index_copy_ each)."""
    syncs: int = 0
    """Waits for the transport's stream (one per chunk)."""
    op_loops: int = 0
    """Chunks whose ops shared no unit small enough in count to index: copied op by op on the device."""
    overflows: int = 0
    """Chunks staged into a one-off host buffer because every pinned send buffer was still on the wire."""

    def add(self, other: StagingCounts) -> StagingCounts:
        return StagingCounts(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})


def ready_marker(region: TensorRegion) -> Any:
    """Called in the caller's thread when a request is made: a CUDA event on the caller's current stream, which
    the transport's stream waits for before touching the region (the KV the caller's kernels write, or the
    blocks they last used); None off CUDA, where the caller's writes are done when it calls."""
    if region.flat.device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(region.flat.device))
    return event


def split(spans: Sequence[Span], capacity: int) -> list[list[Span]]:
    """The spans cut into chunks of at most `capacity` bytes, in order (an op larger than that in pieces)."""
    chunks: list[list[Span]] = []
    current: list[Span] = []
    room = capacity
    for offset, size in spans:
        while size > 0:
            take = min(size, room)
            current.append((offset, take))
            offset += take
            size -= take
            room -= take
            if room == 0:
                chunks.append(current)
                current, room = [], capacity
    if current:
        chunks.append(current)
    return chunks


def unit_index(spans: numpy.ndarray, unit: int) -> numpy.ndarray:
    """The region's unit numbers the spans cover, in order: spans (n, 2) of offsets and sizes, both multiples
    of `unit`. Vectorised: each unit's place in the stream, shifted by where its op starts in the region."""
    starts = spans[:, 0] // unit
    counts = spans[:, 1] // unit
    ends = numpy.cumsum(counts)
    index: numpy.ndarray = numpy.repeat(starts - (ends - counts), counts) + numpy.arange(int(ends[-1]))
    return index


class _Lane:
    """One I/O thread's staging for one device: a device buffer, pinned send buffers with their trackers,
    a pinned receive buffer, and (CUDA) a stream of its own. Used by one thread only."""

    def __init__(self, device: torch.device, capacity: int, buffers: int) -> None:
        self.device = device
        self.capacity = capacity
        self.cuda = device.type == "cuda"
        self.stage = torch.empty(capacity, dtype=torch.uint8, device=device)
        self._sends: list[torch.Tensor | None] = [None] * buffers
        self._trackers: list[zmq.MessageTracker | None] = [None] * buffers
        self._receive: torch.Tensor | None = None
        self.stream: Any = torch.cuda.Stream(device) if self.cuda else None

    def _host(self) -> torch.Tensor:
        return torch.empty(self.capacity, dtype=torch.uint8, pin_memory=self.cuda)

    def send_buffer(self) -> tuple[torch.Tensor, int | None]:
        """A pinned send buffer every frame of which zmq released, and its slot; else a one-off (slot None)."""
        for slot, tracker in enumerate(self._trackers):
            if tracker is None or tracker.done:
                buffer = self._sends[slot]
                if buffer is None:
                    buffer = self._sends[slot] = self._host()
                self._trackers[slot] = None
                return buffer, slot
        return torch.empty(self.capacity, dtype=torch.uint8), None

    def lend(self, slot: int, tracker: zmq.MessageTracker) -> None:
        self._trackers[slot] = tracker

    def receive_buffer(self) -> torch.Tensor:
        if self._receive is None:
            self._receive = self._host()
        return self._receive

    @contextlib.contextmanager
    def on_stream(self, ready: Any) -> Iterator[None]:
        if not self.cuda:
            yield
            return
        with torch.cuda.stream(self.stream):
            if ready is not None:
                self.stream.wait_event(ready)
            yield

    def sync(self) -> None:
        if self.cuda:
            self.stream.synchronize()


def unit_rows(lane: _Lane, region: TensorRegion, chunk: list[Span]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The region as rows of the chunk's unit, and the rows the chunk covers (an index on the lane's device);
    None where the unit is so small that the index would pass TRANSPORT_STAGING_INDEX_MAX entries."""
    spans = numpy.asarray(chunk, dtype=numpy.int64)
    unit = int(numpy.gcd.reduce(spans.ravel()))
    if int(spans[:, 1].sum()) // unit > TRANSPORT_STAGING_INDEX_MAX:
        return None
    units = region.flat[: region.size // unit * unit].view(-1, unit)
    positions = torch.from_numpy(unit_index(spans, unit)).to(lane.device, non_blocking=lane.cuda)
    return units, positions


class Staging:
    """One I/O thread's staging (see the module docstring); `counts` says what it did."""

    def __init__(self, capacity: int = TRANSPORT_STAGING_BYTES, buffers: int = TRANSPORT_STAGING_BUFFERS) -> None:
        if capacity <= 0 or buffers <= 0:
            raise ValueError(f"staging needs a positive size and buffer count, not {capacity} x {buffers}")
        self.capacity = capacity
        self.buffers = buffers
        self.counts = StagingCounts()
        self._lanes: dict[torch.device, _Lane] = {}

    def _lane(self, region: TensorRegion) -> _Lane:
        device = region.flat.device
        lane = self._lanes.get(device)
        if lane is None:
            lane = self._lanes[device] = _Lane(device, self.capacity, self.buffers)
        return lane

    def gather(self, region: TensorRegion, spans: Sequence[Span], ready: Any = None) -> list[Any]:
        """The frames (one per span, in order) of the region's bytes at `spans`: a copy, taken when this returns,
        so the region may change after. Zero-copy slices of a pinned buffer (zmq frames that free the buffer
        for reuse once sent) for a request that fits one; else slices of one host buffer of its size."""
        lane = self._lane(region)
        total = sum(size for _, size in spans)
        chunks = split(spans, self.capacity)
        host, slot = lane.send_buffer()
        if slot is None:
            self.counts.overflows += 1
        whole = host if len(chunks) <= 1 else torch.empty(total, dtype=torch.uint8)
        place = 0
        with lane.on_stream(ready):
            for chunk in chunks:
                size = sum(piece for _, piece in chunk)
                self._gather_chunk(lane, region, chunk, lane.stage[:size])
                host[:size].copy_(lane.stage[:size], non_blocking=lane.cuda)
                self.counts.to_host += 1
                lane.sync()
                self.counts.syncs += 1
                if whole is not host:
                    whole[place : place + size].copy_(host[:size])
                place += size
        array = whole.numpy()
        views: list[memoryview] = []
        place = 0
        for _, size in spans:
            views.append(array[place : place + size].data)
            place += size
        if whole is not host or slot is None:
            return list(views)  # the frames keep `whole` alive until zmq has sent them
        # Below pyzmq's copy threshold a frame is copied into its zmq message here, as pyzmq copies such a frame
        # anywhere: copying a few KiB costs less than a zero-copy frame's bookkeeping (an event and a tracker,
        # and a message to pyzmq's gc thread once zmq frees it, which takes the GIL), which made a served read
        # of 16 KiB ops cost a third more CPU per byte. Larger frames are zero-copy slices, tracked.
        frames = [zmq.Frame(view, track=True, copy_threshold=zmq.COPY_THRESHOLD) for view in views]
        lane.lend(slot, zmq.MessageTracker(*frames))
        return list(frames)

    def _gather_chunk(self, lane: _Lane, region: TensorRegion, chunk: list[Span], out: torch.Tensor) -> None:
        index = unit_rows(lane, region, chunk)
        if index is None:
            place = 0
            for offset, size in chunk:
                out[place : place + size].copy_(region.flat[offset : offset + size])
                place += size
            self.counts.op_loops += 1
            return
        units, positions = index
        torch.index_select(units, 0, positions, out=out.view(-1, units.shape[1]))
        self.counts.gathers += 1

    def inbound(self, region: TensorRegion, ready: Any = None) -> Inbound:
        """Where a request's received frames go, `put` one by one, then `finish`ed."""
        return Inbound(self, self._lane(region), region, ready)


class Inbound:
    """A request's payload on its way into a staged region: frames copied into the pinned receive buffer,
    which goes to the device (one copy) and into the blocks (one scatter) whenever it fills, and at `finish`."""

    def __init__(self, staging: Staging, lane: _Lane, region: TensorRegion, ready: Any) -> None:
        self._staging = staging
        self._lane = lane
        self._region = region
        self._ready = ready
        self._host = lane.receive_buffer()
        self._array = self._host.numpy()
        self._filled = 0
        self._pieces: list[Span] = []

    def put(self, offset: int, data: Any) -> None:
        """Take the bytes of one frame, which belong at `offset` of the region."""
        source = numpy.frombuffer(data, dtype=numpy.uint8)
        done = 0
        while done < len(source):
            take = min(len(source) - done, self._lane.capacity - self._filled)
            self._array[self._filled : self._filled + take] = source[done : done + take]
            self._pieces.append((offset + done, take))
            self._filled += take
            done += take
            if self._filled == self._lane.capacity:
                self._flush()

    def finish(self) -> None:
        """Every byte put is in the region when this returns (synchronised: the caller may report it landed)."""
        self._flush()

    def _flush(self) -> None:
        if not self._filled:
            return
        lane, staging, size = self._lane, self._staging, self._filled
        with lane.on_stream(self._ready):
            self._ready = None  # waited for once, before the first scatter
            lane.stage[:size].copy_(self._host[:size], non_blocking=lane.cuda)
            staging.counts.to_device += 1
            index = unit_rows(lane, self._region, self._pieces)
            if index is None:
                place = 0
                for offset, piece in self._pieces:
                    self._region.flat[offset : offset + piece].copy_(lane.stage[place : place + piece])
                    place += piece
                staging.counts.op_loops += 1
            else:
                units, positions = index
                units.index_copy_(0, positions, lane.stage[:size].view(-1, units.shape[1]))
                staging.counts.scatters += 1
            lane.sync()  # the receive buffer is reused next; the bytes must be in the blocks before we report
            staging.counts.syncs += 1
        self._filled = 0
        self._pieces = []
