"""A peer that accepts tcp requests and never answers (a hung process, a half-open link): its requests fail at
their deadline and free their slots, a reply after that is dropped, and while they wait it holds only its own
share of the in-flight slots, never the other peers'."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import torch
import zmq

from kvledger.connector.limits import TRANSPORT_INFLIGHT_MAX, TRANSPORT_INFLIGHT_PER_PEER_MAX
from kvledger.connector.transports.base import Code, RegionDescriptor, TransportEndpoint
from kvledger.connector.transports.tcp import TcpTransport

WAIT_S = 10.0


class SilentPeer:
    """A real ROUTER on a loopback port that takes every request and answers none (until told to)."""

    def __init__(self) -> None:
        self.context: zmq.Context[Any] = zmq.Context()
        self.sock = self.context.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.received: list[list[bytes]] = []

    def endpoint(self) -> TransportEndpoint:
        return TransportEndpoint(backend="tcp", host="127.0.0.1", port=self.port)

    def take(self, count: int) -> None:
        """Receive `count` requests (so they surely left the client), answering none."""
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while len(self.received) < count:
            assert poller.poll(WAIT_S * 1000), f"{len(self.received)} of {count} requests arrived"
            self.received.append(self.sock.recv_multipart())

    def close(self) -> None:
        self.sock.close(linger=0)
        self.context.term()


@pytest.fixture
def silent() -> Iterator[SilentPeer]:
    peer = SilentPeer()
    yield peer
    peer.close()


def _wait(condition: Any) -> bool:
    done = threading.Event()
    for _ in range(int(WAIT_S / 0.01)):
        if condition():
            return True
        done.wait(0.01)
    return bool(condition())


def test_silent_peer_cannot_starve_other_peers(silent: SilentPeer) -> None:
    """Today the silent peer's requests keep every slot for ever: a read from a live peer then fails with
    SEND_QUEUE_FULL. Now the silent peer is refused at its own share and the live peer is served."""
    client, live = TcpTransport(), TcpTransport()
    try:
        client.register("kv", torch.zeros(64))
        source = torch.arange(64, dtype=torch.float32)
        live_session = client.connect(live.endpoint(), [live.register("kv", source)])
        dead_session = client.connect(silent.endpoint(), [RegionDescriptor(name="kv", size=256)])
        handles = [client.read(dead_session, "kv", "kv", [(0, 0, 4)]) for _ in range(TRANSPORT_INFLIGHT_MAX)]
        refused = [h for h in handles if h.status().failed()]
        assert len(refused) == TRANSPORT_INFLIGHT_MAX - TRANSPORT_INFLIGHT_PER_PEER_MAX
        assert all(h.status().code == Code.SEND_QUEUE_FULL and h.status().transient for h in refused)
        handle = client.read(live_session, "kv", "kv", [(0, 0, 256)])
        assert client.wait_all([handle], WAIT_S), "the live peer's read never finished"
        assert handle.status().succeeded(), handle.status()
        assert torch.equal(client._regions["kv"].tensor, source)
    finally:
        client.close()
        live.close()


def test_silent_peer_requests_fail_at_deadline_and_free_their_slots(silent: SilentPeer) -> None:
    """Today a request to a silent peer is in progress for ever and its slot never comes back."""
    client = TcpTransport(request_timeout_s=0.2)
    try:
        client.register("kv", torch.zeros(64))
        session = client.connect(silent.endpoint(), [RegionDescriptor(name="kv", size=256)])
        handles = [client.read(session, "kv", "kv", [(0, 0, 4)]) for _ in range(8)]
        silent.take(8)
        assert client.wait_all(handles, WAIT_S), "requests to a silent peer never failed"
        assert {h.status().code for h in handles} == {Code.TIMEOUT}
        assert _wait(lambda: client.inflight() == 0), f"{client.inflight()} slots still held"
    finally:
        client.close()


def test_reply_after_the_deadline_is_dropped_unread(silent: SilentPeer) -> None:
    """A reply that comes after its request timed out must not land in blocks the caller gave back."""
    client = TcpTransport(request_timeout_s=0.2)
    try:
        local = torch.zeros(4)
        client.register("kv", local)
        session = client.connect(silent.endpoint(), [RegionDescriptor(name="kv", size=16)])
        handle = client.read(session, "kv", "kv", [(0, 0, 16)])
        silent.take(1)
        assert client.wait_all([handle], WAIT_S) and handle.status().code == Code.TIMEOUT
        identity, header = silent.received[0][0], silent.received[0][1]
        rid = msgspec.msgpack.decode(header)[0]
        reply = msgspec.msgpack.encode([rid, int(Code.OK), ""])
        silent.sock.send_multipart([identity, reply, torch.full((4,), 7.0).numpy().tobytes()])
        probe = client.read(session, "kv", "kv", [(0, 0, 4)])  # the client thread has taken the late reply
        silent.take(2)
        assert client.wait_all([probe], WAIT_S)
        assert torch.equal(local, torch.zeros(4)), "a reply after the deadline was written into the region"
    finally:
        client.close()


def test_request_given_up_by_its_caller_frees_its_slot(silent: SilentPeer) -> None:
    client = TcpTransport()  # the default deadline is far away: only the cancel frees the slot
    try:
        client.register("kv", torch.zeros(64))
        session = client.connect(silent.endpoint(), [RegionDescriptor(name="kv", size=256)])
        handle = client.read(session, "kv", "kv", [(0, 0, 4)])
        silent.take(1)
        assert client.inflight() == 1
        handle.cancel()
        assert handle.status().failed()
        assert _wait(lambda: client.inflight() == 0), "a cancelled request kept its slot"
    finally:
        client.close()
