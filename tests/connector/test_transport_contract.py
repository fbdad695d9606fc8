"""One contract suite for every transport (eventsourcing style): each backend only says how to make a pair.
A mori fake joins by adding a factory to TRANSPORTS."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from kvledger.connector.layout import block_ops, geometry_of
from kvledger.connector.transports.base import Code, Transport
from kvledger.connector.transports.loopback import LoopbackTransport
from kvledger.connector.transports.tcp import TcpTransport
from tests.connector.fake_mori import make_mori_transport

TRANSPORTS: dict[str, Callable[[], Transport]] = {
    "tcp": lambda: TcpTransport("127.0.0.1", 0),
    "loopback": lambda: LoopbackTransport(),
    "mori": make_mori_transport,  # against the fake mori.io (mori needs ROCm hardware)
}
WAIT_S = 10.0


@pytest.fixture(params=sorted(TRANSPORTS))
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[Transport, Transport]]:
    a = TRANSPORTS[request.param]()
    b = TRANSPORTS[request.param]()
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def test_read_and_write_move_exact_bytes(pair: tuple[Transport, Transport]) -> None:
    a, b = pair
    src = torch.arange(256, dtype=torch.float32)
    dst = torch.zeros(256)
    remote = a.register("kv", src)
    b.register("kv", dst)
    session = b.connect(a.endpoint(), [remote])
    handle = b.read(session, "kv", "kv", [(0, 64, 32), (512, 0, 16)])
    assert b.wait_all([handle], WAIT_S) and handle.status().succeeded()
    assert torch.equal(dst[:8], src[16:24]) and torch.equal(dst[128:132], src[:4])
    assert dst[8:128].abs().sum() == 0
    back = b.write(session, "kv", "kv", [(0, 1000, 8)])
    assert b.wait_all([back], WAIT_S) and back.status().succeeded()
    assert torch.equal(src[250:252], dst[0:2])


def test_strided_half_of_a_cache_is_a_region(pair: tuple[Transport, Transport]) -> None:
    a, b = pair
    cache = torch.randn(2, 8, 4)
    remote = a.register("v", cache[1])  # the V half: storage offset != 0
    dst = torch.zeros(8, 4)
    b.register("v", dst)
    handle = b.read(b.connect(a.endpoint(), [remote]), "v", "v", [(0, 0, 8 * 4 * 4)])
    assert b.wait_all([handle], WAIT_S) and handle.status().succeeded()
    assert torch.equal(dst, cache[1])


def test_bad_requests_fail_terminally_at_once(pair: tuple[Transport, Transport]) -> None:
    a, b = pair
    remote = a.register("kv", torch.zeros(16))
    b.register("kv", torch.zeros(16))
    session = b.connect(a.endpoint(), [remote])
    for handle in (
        b.read(session, "kv", "kv", [(0, 60, 8)]),  # past the remote region
        b.read(session, "kv", "kv", [(60, 0, 8)]),  # past the local region
        b.read(session, "nope", "kv", [(0, 0, 4)]),
        b.write(session, "kv", "nope", [(0, 0, 4)]),
    ):
        assert b.wait_all([handle], WAIT_S)
        status = handle.status()
        assert status.failed() and not status.transient and status.code is Code.BAD_REQUEST, status


def test_closed_transport_fails_new_work(pair: tuple[Transport, Transport]) -> None:
    a, b = pair
    remote = a.register("kv", torch.zeros(16))
    b.register("kv", torch.zeros(16))
    session = b.connect(a.endpoint(), [remote])
    b.close()
    handle = b.read(session, "kv", "kv", [(0, 0, 4)])
    assert handle.status().failed() and handle.status().code is Code.CLOSED


# -- byte equality on every device torch reports, through every layout a KV cache takes ------------------------

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
STAGED_BYTES = 3000
"""Smaller than one request below (10 KiB) and than its merged ops, and a multiple of no op size: every request
goes in chunks that cut ops, and its final chunk is partial."""
BYTE_TRANSPORTS: dict[str, Callable[[], Transport]] = {
    **TRANSPORTS,
    # CPU regions through the device path's gather, chunks and scatter (on CUDA every region takes it).
    "tcp-staged": lambda: TcpTransport("127.0.0.1", 0, stage_host_regions=True, staging_bytes=STAGED_BYTES),
}
NUM_BLOCKS = 12
BLOCK_SHAPE = (8, 4, 16)  # tokens, heads, head size: 1 KiB of fp16 for each of K and V
LOCAL_BLOCKS = [7, 2, 11, 3, 4]
REMOTE_BLOCKS = [1, 8, 9, 10, 4]  # runs of adjacent blocks on both sides: merged ops


def _blocks_first(device: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    cache = _random((NUM_BLOCKS, 2, *BLOCK_SHAPE), torch.float16, device, seed)
    return cache, cache


def _kv_split(device: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    cache = _random((2, NUM_BLOCKS, *BLOCK_SHAPE), torch.float16, device, seed)
    return cache, cache


def _k_half(device: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The K half of a blocks-first cache: a strided region whose extent covers V bytes no op names."""
    cache = _random((NUM_BLOCKS, 2, *BLOCK_SHAPE), torch.float16, device, seed)
    return cache, cache[:, 0]


def _permuted(device: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens outermost: each block is 8 runs of one token's heads, NUM_BLOCKS runs apart."""
    storage = _random((BLOCK_SHAPE[0], NUM_BLOCKS, *BLOCK_SHAPE[1:]), torch.float16, device, seed)
    return storage, storage.permute(1, 0, 2, 3)


def _odd_bytes(device: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One-byte runs 5 blocks apart (a transposed uint8 cache): the gather's unit is a single byte."""
    storage = _random((5, NUM_BLOCKS), torch.uint8, device, seed)
    return storage, storage.t()


def _random(shape: tuple[int, ...], dtype: torch.dtype, device: str, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 250, shape, generator=generator, dtype=torch.uint8).to(dtype).to(device)


LAYOUTS: dict[str, Callable[[str, int], tuple[torch.Tensor, torch.Tensor]]] = {
    "blocks-first": _blocks_first,
    "kv-split": _kv_split,
    "k-half-strided": _k_half,
    "permuted": _permuted,
    "odd-bytes": _odd_bytes,
}


@pytest.mark.parametrize("op", ["read", "write"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("backend", sorted(BYTE_TRANSPORTS))
@pytest.mark.parametrize("device", DEVICES)
def test_layouts_move_exact_bytes_on_every_device(device: str, backend: str, layout: str, op: str) -> None:
    """b reads a's blocks into its own (or writes its blocks into a's), paired as the connector pairs them:
    every byte the ops name arrives, and no other byte of either storage changes."""
    if backend == "mori" and device != "cpu":
        pytest.skip("the fake mori.io moves host memory only")
    a, b = BYTE_TRANSPORTS[backend](), BYTE_TRANSPORTS[backend]()
    try:
        a_storage, a_kv = LAYOUTS[layout](device, 1)
        b_storage, b_kv = LAYOUTS[layout](device, 2)
        a_before, b_before = a_storage.clone(), b_storage.clone()
        remote = a.register("kv", a_kv)
        b.register("kv", b_kv)
        session = b.connect(a.endpoint(), [remote])
        ops = block_ops(geometry_of(b_kv, NUM_BLOCKS), geometry_of(a_kv, NUM_BLOCKS), LOCAL_BLOCKS, REMOTE_BLOCKS)
        handle = (b.read if op == "read" else b.write)(session, "kv", "kv", ops)
        assert b.wait_all([handle], WAIT_S) and handle.status().succeeded(), handle.status()
        # The model: whole blocks copied along the block axis, by tensor indexing (not by bytes).
        if op == "read":
            expected, source, changed, unchanged, kept = b_before, a_before, b_storage, a_storage, a_before
            targets, sources = LOCAL_BLOCKS, REMOTE_BLOCKS
        else:
            expected, source, changed, unchanged, kept = a_before, b_before, a_storage, b_storage, b_before
            targets, sources = REMOTE_BLOCKS, LOCAL_BLOCKS
        expected = expected.clone()
        _blocks_of(layout, expected)[targets] = _blocks_of(layout, source)[sources]
        assert torch.equal(changed.cpu(), expected.cpu())
        assert torch.equal(unchanged.cpu(), kept.cpu())
    finally:
        a.close()
        b.close()


def _blocks_of(layout: str, storage: torch.Tensor) -> torch.Tensor:
    """The KV view of a layout's storage, block axis first (what LAYOUTS registers)."""
    if layout == "kv-split":
        return storage.transpose(0, 1)
    if layout == "k-half-strided":
        return storage[:, 0]
    if layout == "permuted":
        return storage.permute(1, 0, 2, 3)
    if layout == "odd-bytes":
        return storage.t()
    return storage
