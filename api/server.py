"""How the service is served: uvicorn's settings that bound what one client can hold.

Which mechanism bounds what (the limits themselves are `Settings` fields):

- header size: h11's `max_incomplete_event_size` (the protocol is pinned to h11: httptools has no
  such limit); a larger request line and headers get 400 and the connection is closed;
- header time: `HeaderTimeoutProtocol` below, the one piece uvicorn lacks: a connection whose next
  request head is not complete `header_timeout_s` after it opened (or after its previous response)
  is closed;
- body time: `kvledger.api.guards.BodyDeadline`, an ASGI middleware: the whole body must arrive within
  `body_timeout_s`, else 408 and close;
- idle keep-alive: uvicorn's `timeout_keep_alive`;
- connections: uvicorn's `limit_concurrency` (new requests beyond it get 503).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvledger.api.settings import Settings

log = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 5
"""Open event streams get this long to end when the server stops, so a stop never hangs on a client."""


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol, plus a deadline on each request head (uvicorn has none: a client that
    sends half a header, or nothing at all, would hold its connection for ever)."""

    header_timeout_s: float = 10.0
    """Set per server by `server_config` (uvicorn makes a protocol object per connection from the class)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._disarm()  # the head is in: the body's own deadline (kvledger.api.guards) takes over

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm()  # the next request's head is due as well

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._head_deadline = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _disarm(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_timed_out(self) -> None:
        self._head_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            log.debug("closing %s: no complete request head within %s s", self.client, self.header_timeout_s)
            self.transport.close()


def server_config(app: FastAPI, settings: Settings, *, host: str, port: int, log_level: str = "info") -> uvicorn.Config:
    """The uvicorn configuration `kvledger serve` (and the tests' real servers) run the app with."""
    protocol = type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"header_timeout_s": settings.header_timeout_s})
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=protocol,
        h11_max_incomplete_event_size=settings.header_bytes_max,
        timeout_keep_alive=settings.keep_alive_s,  # type: ignore[arg-type]  # a float works: it is a call_later delay
        limit_concurrency=settings.connections_max,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        log_level=log_level,
    )
