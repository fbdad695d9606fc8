"""The 1P1D proxy: an OpenAI-compatible front that splits each completion into a prefill and a decode.

It chooses the transfer id, puts `kv_transfer_params` into both requests and
streams the decode server's answer back. READ (the consumer pulls): prefill
first with `max_tokens=1`, then decode with the params the producer returned.
WRITE (the producer pushes): both at once, each told the other's ports. The
engines must name each other in `peers`; the proxy never moves KV itself.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvledger.ledger.ids import stamped_id

log = logging.getLogger(__name__)

PROXY_TIMEOUT_S = 600.0
"""Per backend request: a long decode may stream for minutes; a dead server fails at connect instead."""


@dataclass(frozen=True)
class KvAddress:
    """Where an engine's connector listens (rank 0 base ports): what the other side is told in WRITE mode."""

    host: str
    handshake_port: int
    notify_port: int

    @classmethod
    def parse(cls, text: str) -> KvAddress:
        """`host:handshake_port:notify_port`, e.g. `127.0.0.1:7100:7200`."""
        host, handshake, notify = text.rsplit(":", 2)
        return cls(host, int(handshake), int(notify))

    def params(self) -> dict[str, Any]:
        return {
            "remote_host": self.host,
            "remote_handshake_port": self.handshake_port,
            "remote_notify_port": self.notify_port,
        }


@dataclass(frozen=True)
class ProxySettings:
    prefill_url: str
    decode_url: str
    mode: str = "read"
    prefill_kv: KvAddress | None = None
    decode_kv: KvAddress | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("read", "write"):
            raise ValueError(f"mode: expected read or write, got {self.mode!r}")
        if self.mode == "write" and (self.prefill_kv is None or self.decode_kv is None):
            raise ValueError("WRITE mode needs both engines' KV addresses (--prefill-kv and --decode-kv)")


def new_transfer_id() -> str:
    """A stamped id (ledger/ids.py): issued now, so the ledger judges it by time once it is older than
    `ID_WINDOW_S` and need not remember it past that."""
    return stamped_id(time.time(), os.urandom(10))


def prefill_body(body: dict[str, Any], kv_transfer_params: dict[str, Any]) -> dict[str, Any]:
    """The prefill server computes the prompt and one token; its answer is not the client's."""
    out = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": kv_transfer_params}
    out.pop("stream_options", None)
    out.pop("max_completion_tokens", None)
    return out


def create_app(settings: ProxySettings) -> FastAPI:
    client = httpx.AsyncClient(timeout=httpx.Timeout(PROXY_TIMEOUT_S, connect=10.0))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = FastAPI(title="kvledger 1P1D proxy", lifespan=lifespan)

    async def _prefill(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
        response = await client.post(f"{settings.prefill_url}/v1/completions", json=prefill_body(body, params))
        response.raise_for_status()
        answer: dict[str, Any] = response.json()
        return answer

    async def _decode(body: dict[str, Any]) -> Response:
        request = client.build_request("POST", f"{settings.decode_url}/v1/completions", json=body)
        upstream = await client.send(request, stream=True)
        if not body.get("stream"):
            content = await upstream.aread()
            await upstream.aclose()
            return Response(content, status_code=upstream.status_code, media_type="application/json")

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()

        return StreamingResponse(relay(), status_code=upstream.status_code, media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body: dict[str, Any] = await request.json()
        tid = new_transfer_id()
        if settings.mode == "read":
            try:
                prefilled = await _prefill(body, {"do_remote_decode": True, "transfer_id": tid})
            except httpx.HTTPError as error:
                return JSONResponse({"error": f"prefill failed: {error}"}, status_code=502)
            params = prefilled.get("kv_transfer_params")
            if not params:
                return JSONResponse({"error": "prefill returned no kv_transfer_params"}, status_code=502)
            return await _decode({**body, "kv_transfer_params": params})
        assert settings.prefill_kv is not None and settings.decode_kv is not None
        to_prefill = {"do_remote_decode": True, "transfer_id": tid, **settings.decode_kv.params()}
        to_decode = {"do_remote_prefill": True, "transfer_id": tid, **settings.prefill_kv.params()}
        prefill = asyncio.create_task(_prefill(body, to_prefill))
        prefill.add_done_callback(_log_failure)
        return await _decode({**body, "kv_transfer_params": to_decode})

    @app.get("/v1/models")
    async def models() -> Response:
        upstream = await client.get(f"{settings.decode_url}/v1/models")
        return Response(upstream.content, status_code=upstream.status_code, media_type="application/json")

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok", "mode": settings.mode}

    return app


def _log_failure(task: asyncio.Task[dict[str, Any]]) -> None:
    # WRITE: the client's answer comes from the decode server; a failed prefill shows up there as a
    # load failure, and here only in the log.
    if not task.cancelled() and task.exception() is not None:
        log.warning("prefill failed: %s", task.exception())
