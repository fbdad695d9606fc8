"""One contract suite for every transport (eventsourcing style): each backend only says how to make a pair.
A mori fake joins by adding a factory to TRANSPORTS."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from connector.transports.base import Code, Transport
from connector.transports.loopback import LoopbackTransport
from connector.transports.tcp import TcpTransport
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
