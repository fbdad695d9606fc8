"""Operations endpoints: liveness, readiness (store reachable, schema current) and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.concurrency import run_in_threadpool

from api.deps import LiveDep
from api.schemas import Health, Ready
from api.views import display_url
from ledger.store.base import StoreError

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
        try:
            # A round trip now, not the last poll's word: readiness must reflect the store this moment.
            await run_in_threadpool(live.store.count)
        except StoreError as failure:
            error = f"{type(failure).__name__}: {failure}"
    ready = Ready(ready=error is None, store=display_url(live.settings.db),
                  cursor=live.cursor, error=error)  # fmt: skip
    if error is None:
        return ready
    return JSONResponse(ready.model_dump(), status_code=503)


@router.get(
    "/metrics",
    summary="Prometheus metrics (text exposition format)",
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}}},
)
async def metrics(request: Request) -> Response:
    registry: CollectorRegistry = request.app.state.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
