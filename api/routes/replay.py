"""POST /replay: fold an uploaded incident log offline, never touching the live store.

No token is needed (it reads nothing of the store), so an upload must not be able to hold what
others need: a replay slot (`replays_at_once_max`) is taken only once the upload is read, the
body must arrive within `body_timeout_s` (kvledger.api.guards), and at most `replay_uploads_at_once_max`
uploads are read at once (each is a temporary file of up to `replay_body_bytes_max`)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Annotated, Any, Protocol

from fastapi import APIRouter, HTTPException, Query, Request
from starlette.concurrency import run_in_threadpool

from kvledger.api.deps import LiveDep
from kvledger.api.errors import read_limited
from kvledger.api.params import check_limit
from kvledger.api.replay import replay_file
from kvledger.api.schemas import ReplayOut
from kvledger.api.settings import Settings
from kvledger.ledger.audit import AuditConfig
from kvledger.ledger.limits import TS_MAX

router = APIRouter(tags=["replay"])

_BINARY = {"schema": {"type": "string", "format": "binary"}}


class Replaying(Protocol):
    """What a replay reads and counts of a service (the one-process service's `Live`, the workers' `Fleet`)."""

    settings: Settings
    audit_config: AuditConfig
    uploads_running: int
    replays_running: int


REPLAY_ROUTE: dict[str, Any] = {
    "response_model": ReplayOut,
    "summary": "Replay an incident log (JSONL, or a SQLite ledger file) up to a seq or ts",
    "openapi_extra": {
        "requestBody": {
            "required": True,
            "description": "The log itself as the body (streamed; size-limited)",
            "content": {"application/x-ndjson": _BINARY, "application/octet-stream": _BINARY},
        }
    },
    "responses": {
        408: {"description": "The body did not arrive in time"},
        413: {"description": "Body too large"},
        429: {"description": "Too many uploads or replays at once"},
    },
}
"""POST /replay's declaration, the one-process service's and the partition workers' (`fleet_app`)."""
UntilSeq = Annotated[int | None, Query(ge=0, le=1 << 62, description="Fold events with seq <= this")]
UntilTs = Annotated[float | None, Query(ge=0, le=TS_MAX, description="Fold events with ts <= this")]
ReplayLimit = Annotated[int, Query(ge=1, le=1 << 30, description="Decisions and findings listed")]


@router.post("/replay", **REPLAY_ROUTE)
async def replay(
    request: Request, live: LiveDep, until_seq: UntilSeq = None, until_ts: UntilTs = None, limit: ReplayLimit = 100
) -> ReplayOut:
    return await replayed(request, live, until_seq, until_ts, limit)


async def replayed(
    request: Request, service: Replaying, until_seq: int | None, until_ts: float | None, limit: int
) -> ReplayOut:
    """POST /replay's answer: the uploaded log read to a temporary file, then replayed on a thread."""
    check_limit(service, limit)
    if service.uploads_running >= service.settings.replay_uploads_at_once_max:
        raise HTTPException(429, f"{service.uploads_running} uploads are being read; try again shortly")
    with tempfile.TemporaryDirectory(prefix="kvledger-replay-") as folder:
        path = Path(folder) / "upload"
        service.uploads_running += 1
        try:
            with open(path, "wb") as file:
                async for chunk in read_limited(request, service.settings.replay_body_bytes_max):
                    file.write(chunk)
        finally:
            service.uploads_running -= 1
        if service.replays_running >= service.settings.replays_at_once_max:
            raise HTTPException(429, f"{service.replays_running} replays are running; try again shortly")
        service.replays_running += 1
        try:
            return await run_in_threadpool(
                replay_file,
                path,
                until_seq=until_seq,
                until_ts=until_ts,
                limit=limit,
                config=service.audit_config,
            )
        finally:
            service.replays_running -= 1
