"""The staging path's design guards, on CPU tensors flagged `staged` (the same code a CUDA region runs): one
gather and one copy per request (not per op), chunks for a request larger than a buffer, the next request
staged while the last is still on the wire (in the staging alone, and for a WRITE's per-layer pushes between
two transports), and the op-by-op fallback for ragged ops."""

from __future__ import annotations

import gc
import math
import threading
from collections.abc import Sequence
from typing import Any

import pytest
import torch
import zmq

from kvledger.connector.layout import block_ops, geometry_of
from kvledger.connector.limits import TRANSPORT_STAGING_BYTES
from kvledger.connector.transports import staging as staging_module
from kvledger.connector.transports.regions import TensorRegion
from kvledger.connector.transports.staging import Inbound, Span, Staging, split, unit_index
from kvledger.connector.transports.tcp import TcpTransport

WAIT_S = 10.0
NUM_BLOCKS = 16
BLOCKS = [3, 9, 0, 14, 6, 11]  # no two adjacent: one op per block and K/V half, twelve in all


def _cache(seed: int) -> torch.Tensor:
    """A K/V-split cache (2, blocks, tokens, heads, head size) of fp16: 2 KiB per block and half."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 250, (2, NUM_BLOCKS, 8, 4, 32), generator=generator, dtype=torch.uint8).half()


def _pair(staging_bytes: int = TRANSPORT_STAGING_BYTES) -> tuple[TcpTransport, TcpTransport]:
    return (
        TcpTransport("127.0.0.1", 0, stage_host_regions=True, staging_bytes=staging_bytes),
        TcpTransport("127.0.0.1", 0, stage_host_regions=True, staging_bytes=staging_bytes),
    )


@pytest.mark.parametrize("op", ["read", "write"])
def test_one_gather_one_copy_one_scatter_per_request(op: str) -> None:
    a, b = _pair()
    try:
        source, target = _cache(1), _cache(2)
        remote = a.register("kv", source if op == "read" else target)
        b.register("kv", target if op == "read" else source)
        geometry = geometry_of(source, NUM_BLOCKS)
        ops = block_ops(geometry, geometry, BLOCKS, BLOCKS)
        assert len(ops) == 2 * len(BLOCKS)  # a per-op design would copy twelve times
        session = b.connect(a.endpoint(), [remote])
        handle = (b.read if op == "read" else b.write)(session, "kv", "kv", ops)
        assert b.wait_all([handle], WAIT_S) and handle.status().succeeded(), handle.status()
        assert torch.equal(target[:, BLOCKS], source[:, BLOCKS])
        sender, receiver = (a, b) if op == "read" else (b, a)
        sent, received = sender.staging_counts(), receiver.staging_counts()
        assert (sent.gathers, sent.to_host, sent.syncs, sent.to_device, sent.scatters) == (1, 1, 1, 0, 0)
        assert (received.gathers, received.to_host, received.to_device, received.scatters) == (0, 0, 1, 1)
        assert received.syncs == 1 and sent.op_loops == received.op_loops == 0
    finally:
        a.close()
        b.close()


def test_a_request_larger_than_the_buffer_goes_in_chunks() -> None:
    capacity = 5000  # smaller than one op and than the request, and no multiple of either: chunks cut ops
    a, b = _pair(staging_bytes=capacity)
    try:
        source, target = _cache(3), _cache(4)
        remote = a.register("kv", source)
        b.register("kv", target)
        geometry = geometry_of(source, NUM_BLOCKS)
        ops = block_ops(geometry, geometry, list(range(8)), list(range(8, 16)))  # runs merge: two 16 KiB ops
        total = sum(size for _, _, size in ops)
        assert max(size for _, _, size in ops) > capacity
        handle = b.read(b.connect(a.endpoint(), [remote]), "kv", "kv", ops)
        assert b.wait_all([handle], WAIT_S) and handle.status().succeeded(), handle.status()
        assert torch.equal(target[:, :8], source[:, 8:]) and torch.equal(target[:, 8:], _cache(4)[:, 8:])
        chunks = math.ceil(total / capacity)
        assert a.staging_counts().to_host == a.staging_counts().gathers == chunks
        assert b.staging_counts().to_device == b.staging_counts().scatters == chunks
    finally:
        a.close()
        b.close()


def test_the_next_request_is_staged_while_the_last_is_on_the_wire() -> None:
    """Zero-copy frames zmq still holds keep their pinned buffer busy: the next request takes the other one
    (the overlap of a WRITE's layer n+1 copy with layer n's send), a third overflows into a one-off buffer
    rather than wait, and a buffer is reused once zmq let go of every frame of it."""
    op = zmq.COPY_THRESHOLD  # the smallest frame pyzmq sends zero-copy
    staging = Staging(capacity=4 * op, buffers=2)
    region = TensorRegion(torch.randint(0, 250, (16 * op,), dtype=torch.uint8), staged=True)
    first = staging.gather(region, [(0, op), (4 * op, op)])
    second = staging.gather(region, [(8 * op, 2 * op)])
    assert all(isinstance(frame, zmq.Frame) for frame in first + second)
    assert _buffer_of(first[0]) != _buffer_of(second[0]) and staging.counts.overflows == 0
    third = staging.gather(region, [(0, op)])
    assert staging.counts.overflows == 1 and not isinstance(third[0], zmq.Frame)
    assert bytes(third[0]) == region.flat[:op].numpy().tobytes()
    assert bytes(first[1]) == region.flat[4 * op : 5 * op].numpy().tobytes()
    first_buffer = _buffer_of(first[0])
    del first
    gc.collect()
    fourth = staging.gather(region, [(op, op)])
    assert staging.counts.overflows == 1 and _buffer_of(fourth[0]) == first_buffer
    assert bytes(fourth[0]) == region.flat[op : 2 * op].numpy().tobytes()


def test_frames_below_the_copy_threshold_are_copies_that_hold_no_buffer() -> None:
    """Frames smaller than pyzmq's copy threshold are copied into their zmq messages when staged, so however
    many such requests wait for the wire, none holds a pinned buffer (none overflows) and each keeps the bytes
    the region had when it was staged."""
    staging = Staging(capacity=4096, buffers=2)
    region = TensorRegion(torch.zeros(4096, dtype=torch.uint8), staged=True)
    requests = []
    for value in range(5):
        region.flat[:2048] = value
        requests.append(staging.gather(region, [(0, 1024), (1024, 1024)]))
    assert staging.counts.overflows == 0 and staging.counts.to_host == 5
    for value, frames in enumerate(requests):
        assert all(isinstance(frame, zmq.Frame) and frame.tracker.done for frame in frames)
        assert [bytes(frame) for frame in frames] == [bytes([value]) * 1024] * 2


def test_per_layer_write_pushes_stage_the_next_layer_before_the_last_is_answered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """WRITE mode's per-layer pushes through two real transports on loopback: the sender's I/O thread gathers
    and copies layer n+1 while layer n is still unanswered (on the wire, or with the receiver). The receiver
    holds its answer to each layer until the sender has staged the next one, so a sender that waited for
    layer n's reply before staging layer n+1 would stage it only after that answer (once the guard's wait ran
    out): the recorded order would show it."""
    layers = 4
    events: list[tuple[str, int]] = []
    lock = threading.Lock()
    staged = [threading.Event() for _ in range(layers)]
    sources = [_cache(10 + i) for i in range(layers)]
    targets = [_cache(20 + i) for i in range(layers)]
    layer_of = {id(tensor): i for i, tensor in enumerate(sources + targets)}

    def record(kind: str, layer: int) -> None:
        with lock:
            events.append((kind, layer))

    gather, inbound, finish = Staging.gather, Staging.inbound, Inbound.finish

    def recorded_gather(self: Staging, region: TensorRegion, spans: Sequence[Span], ready: Any = None) -> list[Any]:
        frames = gather(self, region, spans, ready)  # the device gather, the host copy and its sync
        layer = layer_of[id(region.tensor)] % layers
        record("staged", layer)
        staged[layer].set()
        return frames

    def held_inbound(self: Staging, region: TensorRegion, ready: Any = None) -> Inbound:
        layer = layer_of[id(region.tensor)] % layers
        record("received", layer)
        if layer + 1 < layers:
            staged[layer + 1].wait(WAIT_S)  # a guard against a deadlock, never a measure: the order tells
        return inbound(self, region, ready)

    def recorded_finish(self: Inbound) -> None:
        finish(self)
        record("answered", layer_of[id(self._region.tensor)] % layers)  # the reply goes out after this

    monkeypatch.setattr(Staging, "gather", recorded_gather)
    monkeypatch.setattr(Staging, "inbound", held_inbound)
    monkeypatch.setattr(Inbound, "finish", recorded_finish)
    a, b = _pair()
    try:
        remotes = [a.register(f"layer.{i}", target) for i, target in enumerate(targets)]
        for i, source in enumerate(sources):
            b.register(f"layer.{i}", source)
        session = b.connect(a.endpoint(), remotes)
        geometry = geometry_of(sources[0], NUM_BLOCKS)
        ops = block_ops(geometry, geometry, BLOCKS, BLOCKS)
        handles = [b.write(session, f"layer.{i}", f"layer.{i}", ops) for i in range(layers)]  # as the forward
        assert b.wait_all(handles, 2 * layers * WAIT_S)
        assert all(handle.status().succeeded() for handle in handles), [h.status() for h in handles]
        for source, target in zip(sources, targets, strict=True):
            assert torch.equal(target[:, BLOCKS], source[:, BLOCKS])
        with lock:
            order = list(events)
        for layer in range(layers - 1):
            assert order.index(("staged", layer + 1)) < order.index(("answered", layer)), order
        assert [e for e in order if e[0] == "staged"] == [("staged", i) for i in range(layers)]
        assert b.staging_counts().gathers == layers and a.staging_counts().scatters == layers
    finally:
        a.close()
        b.close()


def _buffer_of(frame: zmq.Frame) -> int:
    """The address of the pinned buffer a frame is a slice of (the first frame starts it)."""
    view = memoryview(frame.buffer)
    return int(torch.frombuffer(view, dtype=torch.uint8).data_ptr()) if len(view) else 0


def test_ragged_ops_fall_back_to_a_copy_per_op_on_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ops sharing no unit the index can afford are copied op by op on the device: the same bytes, still one
    host copy per chunk."""
    monkeypatch.setattr(staging_module, "TRANSPORT_STAGING_INDEX_MAX", 4)
    staging = Staging(capacity=64)
    source = TensorRegion(torch.randint(0, 250, (300,), dtype=torch.uint8), staged=True)
    spans = [(7, 3), (101, 50), (13, 1), (200, 41)]  # 95 bytes: two chunks, each of unit 1
    frames = staging.gather(source, spans)
    assert [bytes(f) for f in frames] == [source.flat[o : o + s].numpy().tobytes() for o, s in spans]
    assert staging.counts.op_loops == 2 and staging.counts.gathers == 0 and staging.counts.to_host == 2
    target = TensorRegion(torch.zeros(300, dtype=torch.uint8), staged=True)
    inbound = staging.inbound(target)
    for (offset, _), frame in zip(spans, frames, strict=True):
        inbound.put(offset, frame)
    inbound.finish()
    expected = torch.zeros(300, dtype=torch.uint8)
    for offset, size in spans:
        expected[offset : offset + size] = source.flat[offset : offset + size]
    assert torch.equal(target.flat, expected) and staging.counts.to_device == 2


def test_split_and_unit_index() -> None:
    assert split([(0, 10), (100, 3), (50, 0), (200, 9)], 8) == [[(0, 8)], [(8, 2), (100, 3), (200, 3)], [(203, 6)]]
    assert split([], 8) == []
    spans = torch.tensor([[32, 16], [0, 8], [96, 24]]).numpy()
    assert unit_index(spans, 8).tolist() == [4, 5, 0, 12, 13, 14]
