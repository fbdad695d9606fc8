"""Operations endpoints: liveness, readiness (store reachable, schema current), Prometheus metrics, and
the store's quarantine (events it refused for their content)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from kvledger.api.deps import LiveDep, StoreDep
from kvledger.api.params import check_limit
from kvledger.api.schemas import Health, QuarantinedOut, QuarantineOut, Ready
from kvledger.api.views import display_url
from kvledger.ledger.store.base import Quarantined, StoreError

router = APIRouter(tags=["operations"])


@router.get("/healthz", response_model=Health, summary="The process is up")
async def healthz() -> Health:
    return Health(status="ok")


@router.get(
    "/readyz",
    response_model=Ready,
    summary="The store answers and its schema is the one this code knows",
    responses={503: {"model": Ready, "description": "Not ready: the store is down or its schema is unknown"}},
)
async def readyz(live: LiveDep) -> Ready | JSONResponse:
    error = live.store_error
    if live.store is not None:
        # A round trip now, not the last poll's word: readiness must reflect the store this moment. One
        # indexed row at most (a count would scan), and bounded: a store that does not answer in time is not
        # ready, and the probe never waits behind a lock for as long as the lock is held.
        probe = live.store_call(live.store.tail, live.cursor, 1)
        error = await store_answer_error(probe, live.settings.ready_timeout_s) or error
    return ready_response(Ready(ready=error is None, store=display_url(live.settings.db), cursor=live.cursor,
                                error=error))  # fmt: skip


async def store_answer_error(call: Awaitable[object], timeout_s: float) -> str | None:
    """Why the store's round trip `call` failed (its `StoreError`, or no answer within `timeout_s`); None when it
    answered. A round trip that outlives the timeout goes on on its thread; the probe does not wait for it."""
    try:
        async with asyncio.timeout(timeout_s):
            await call
    except StoreError as failure:
        return f"{type(failure).__name__}: {failure}"
    except TimeoutError:
        return f"the store did not answer within {timeout_s:g} s"
    return None


def ready_response(ready: Ready) -> Ready | JSONResponse:
    """`ready` as GET /readyz answers it: 200 when ready, else 503 with the same body."""
    return ready if ready.ready else JSONResponse(ready.model_dump(), status_code=503)


@router.get(
    "/metrics",
    summary="Prometheus metrics (text exposition format)",
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}}},
)
async def metrics(request: Request) -> Response:
    registry: CollectorRegistry = request.app.state.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


@router.get(
    "/quarantine",
    response_model=QuarantineOut,
    summary="Events the store refused for their content (never retried), newest last",
)
async def get_quarantine(
    live: LiveDep, store: StoreDep, limit: Annotated[int, Query(ge=1, le=1 << 30)] = 100
) -> QuarantineOut:
    check_limit(live, limit)
    total = await live.store_call(store.quarantined_count)
    return quarantine_out(total, await live.store_call(store.quarantined, limit=limit))


def quarantine_out(total: int, rows: list[Quarantined]) -> QuarantineOut:
    """GET /quarantine's answer: the count and the rows read."""
    return QuarantineOut(
        total=total,
        events=[
            QuarantinedOut(
                id=q.id, created_ts=q.created_ts, source=q.source, seq=q.seq, reason=q.reason,
                event=q.body.decode("utf-8", "replace"),
            )
            for q in rows
        ],
    )  # fmt: skip
