"""An ASGI middleware bounding the time a request's body may take to arrive (uvicorn has no such limit).

The deadline covers the whole body, not the gap between two chunks: a client trickling one byte a
second holds its connection for `body_timeout_s` at most. Past it the request gets 408 with
`Connection: close`. Once the body is complete, `receive` is passed through untouched (a live
stream waits on it for the client's disconnect, which may come an hour later).
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvledger.api.errors import InvalidBody


class BodyDeadline:
    def __init__(self, app: ASGIApp, body_timeout_s: float) -> None:
        self.app = app
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout_s
        body_done = False

        async def receive_within_deadline() -> Message:
            nonlocal body_done
            if body_done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                raise InvalidBody(("body",), f"the body did not arrive within {self.body_timeout_s:g} s", 408) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        await self.app(scope, receive_within_deadline, send)
