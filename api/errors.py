"""Expected rejections as 4xx answers naming the field; store outages as 503; never a bare 500."""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from kvledger.ledger.store.base import ConflictError, StoreError

log = logging.getLogger(__name__)

CLOSE_AFTER = frozenset({408, 413})
"""Answers given before the body was read to its end: the connection cannot carry another request."""

_MSGSPEC_PATH = re.compile(r"\.(\w+)|\[(\d+)\]")


class InvalidBody(Exception):
    """A request body that does not say what the schema says; `loc` names the field."""

    def __init__(self, loc: tuple[str | int, ...], message: str, status_code: int = 422) -> None:
        super().__init__(message)
        self.loc = loc
        self.message = message
        self.status_code = status_code


def msgspec_loc(text: str) -> tuple[tuple[str | int, ...], str]:
    """Split msgspec's "message - at `$.events[3].seq`" into ("events", 3, "seq") and the message."""
    message, _, path = text.partition(" - at `$")
    loc: list[str | int] = [name if name else int(index) for name, index in _MSGSPEC_PATH.findall(path.rstrip("`"))]
    return tuple(loc), message


async def read_limited(request: Request, bytes_max: int) -> AsyncIterator[bytes]:
    """Stream the body, refusing (413) before reading past `bytes_max`."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > bytes_max:
        raise InvalidBody(("body",), f"body of {declared} bytes exceeds the limit of {bytes_max}", 413)
    seen = 0
    async for chunk in request.stream():
        seen += len(chunk)
        if seen > bytes_max:
            raise InvalidBody(("body",), f"body exceeds the limit of {bytes_max} bytes", 413)
        yield chunk


def _detail(loc: tuple[str | int, ...], message: str) -> dict[str, object]:
    return {"detail": [{"loc": list(loc), "msg": message, "type": "value_error"}]}


def install(app: FastAPI) -> None:
    @app.exception_handler(InvalidBody)
    async def invalid_body(_: Request, error: InvalidBody) -> JSONResponse:
        headers = {"Connection": "close"} if error.status_code in CLOSE_AFTER else None
        return JSONResponse(_detail(error.loc, error.message), status_code=error.status_code, headers=headers)

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, _: ClientDisconnect) -> Response:
        # The client's own doing, not the service's: nothing to alarm anyone with, and no one to answer.
        log.debug("client %s went away during %s %s", request.client, request.method, request.url.path)
        return Response(status_code=400, headers={"Connection": "close"})

    @app.exception_handler(ConflictError)
    async def conflict(_: Request, error: ConflictError) -> JSONResponse:
        return JSONResponse(_detail(("body", "events"), str(error)), status_code=409)

    @app.exception_handler(StoreError)
    async def store_down(_: Request, error: StoreError) -> JSONResponse:
        return JSONResponse({"detail": f"store unavailable: {type(error).__name__}: {error}"}, status_code=503)
