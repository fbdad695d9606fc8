"""The silent peer (the `silent_peer` fault): a real ROUTER on the loopback that takes every tcp transport request
sent to it and answers none, as a hung engine or a half-open link does. A transfer with the fault has its
transport requests sent here instead of to its peer's transport (`FaultyTransport`), so they occupy the real
transport's in-flight slots exactly as requests to a silent engine would."""

from __future__ import annotations

from typing import Any

import zmq

from kvledger.connector.transports.base import TransportEndpoint

HOST = "127.0.0.1"


class SilentPeer:
    """Owned by the driver, read only at round boundaries (`drain`), so it never answers and never fills
    ZMQ's queue (a full one would block the client thread's send, which is not this fault)."""

    def __init__(self) -> None:
        self._context: zmq.Context[Any] = zmq.Context()
        self._sock = self._context.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self.port = self._sock.bind_to_random_port(f"tcp://{HOST}")
        self.received = 0
        """Requests taken (and never answered)."""

    def endpoint(self) -> TransportEndpoint:
        return TransportEndpoint(backend="tcp", host=HOST, port=self.port)

    def drain(self) -> None:
        """Take every request waiting, answering none."""
        while self._sock.poll(0):
            self._sock.recv_multipart(copy=False)
            self.received += 1

    def close(self) -> None:
        self._sock.close(linger=0)
        self._context.term()
