"""The app `kvledger serve --db nats://... --partitions P` runs: the API over partition workers (`kvledger.api.fleet`).

It answers what the one-process service answers, with its shapes and rendering: `/healthz`, `/readyz` (the
store and every worker answer), `/quarantine`, the event tail (`/events`, `/events/stream`), ingest
(`POST /events`: stored, then folded by the workers from the store), `POST /replay`, and, merged from the
workers (`kvledger.api.fleet_figures`, `kvledger.api.fleet_pages`), `/audit`, `/audit/summary`, `/transfers`,
`/transfers/{id}`, `/requests/{id}`, `/metrics` and the page (`/`, `/ui/findings`, `/ui/transfers/{id}`); and
`/fleet/answers` and `/fleet/status` for services that split the partitions. What a merge cannot say (the
blocks-held plot, the release-latency histogram): docs/fleet.md.
"""

from __future__ import annotations

import asyncio
import gc
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated

import msgspec
from fastapi import APIRouter, FastAPI, HTTPException, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.templating import Jinja2Templates

from kvledger.api import errors
from kvledger.api.fleet import Fleet, WorkerLost
from kvledger.api.fleet_pages import FleetBoards, FleetTransfers, FleetTrust, fleet_registry, summary
from kvledger.api.limits import GIL_SWITCH_INTERVAL_S
from kvledger.api.params import (
    Cursor,
    HasFindingFilter,
    Limit,
    ModeFilter,
    Now,
    RequestIdFilter,
    RequestIdPath,
    SourceFilter,
    TransferIdPath,
    check_limit,
)
from kvledger.api.routes import health, web
from kvledger.api.routes.audit import FindingCode, PublishedAnswers, audit_out
from kvledger.api.routes.events import (
    INGEST_ROUTE,
    STREAM_ROUTE,
    AfterSeq,
    event_stream,
    failure_recorded,
    ingest_result,
    ingested,
    tail_page,
)
from kvledger.api.routes.health import quarantine_out, ready_response, store_answer_error
from kvledger.api.routes.replay import REPLAY_ROUTE, ReplayLimit, UntilSeq, UntilTs, replayed
from kvledger.api.routes.transfers import SCAN_SIDES_MAX, transfer_detail
from kvledger.api.schemas import (
    AuditOut,
    AuditSummary,
    EventPage,
    Health,
    IngestResult,
    QuarantineOut,
    Ready,
    ReplayOut,
    RequestDetail,
    TransferDetail,
    TransferPage,
)
from kvledger.api.settings import Settings
from kvledger.api.views import display_url, transfer_out
from kvledger.ledger.audit import Finding
from kvledger.ledger.fleet import SidesAsked, cursor_shift, through_cursor
from kvledger.ledger.lifecycle import PhaseName
from kvledger.ledger.partitioned import PartitionAnswer

router = APIRouter()


def _fleet(request: Request) -> Fleet:
    fleet: Fleet = request.app.state.fleet
    return fleet


@router.get("/healthz", response_model=Health)
async def healthz() -> Health:
    return Health(status="ok")


@router.get(
    "/readyz",
    response_model=Ready,
    summary="The store answers, and so does every partition worker",
    responses={503: {"model": Ready, "description": "Not ready: the store or a worker did not answer"}},
)
async def readyz(request: Request) -> Ready | JSONResponse:
    """Ready when the store answers a read of one event and every worker its status, each within
    `ready_timeout_s`. The cursor: the least position every owned partition has folded through (a worker that
    did not answer: as far as its partitions told the published audit)."""
    fleet = _fleet(request)
    timeout_s = fleet.settings.ready_timeout_s
    told = fleet.live_merge.told
    probe = fleet.store_call(fleet.store.tail, fleet.told_through(), 1)
    store_error, (folded, silent) = await asyncio.gather(
        store_answer_error(probe, timeout_s), fleet.status_within(timeout_s)
    )
    errors = [store_error] if store_error is not None else []
    errors += [f"the worker of partitions {p} did not answer within {timeout_s:g} s" for p in silent]
    shift = cursor_shift(fleet.store)  # a worker's status is in stream positions, the merge's in cursors
    cursor = min(through_cursor(folded[p][1], shift) if p in folded else told[p] for p in fleet.owned)
    return ready_response(Ready(ready=not errors, store=display_url(fleet.settings.db), cursor=cursor,
                                error="; ".join(errors) or None))  # fmt: skip


@router.get("/quarantine", response_model=QuarantineOut, summary="Events the store refused for their content")
async def get_quarantine(request: Request, limit: Annotated[int, Query(ge=1, le=1 << 30)] = 100) -> QuarantineOut:
    fleet = _fleet(request)
    check_limit(fleet, limit)
    total = await fleet.store_call(fleet.store.quarantined_count)
    return quarantine_out(total, await fleet.store_call(fleet.store.quarantined, limit=limit))


@router.get("/events", response_model=EventPage, summary="Events after a store-wide cursor")
async def tail(
    request: Request, after_seq: AfterSeq = 0, limit: Annotated[int, Query(ge=1, le=1 << 30)] = 100
) -> EventPage:
    return await tail_page(_fleet(request), after_seq, limit)


@router.get("/events/stream", **STREAM_ROUTE)
async def stream(request: Request, after_seq: AfterSeq = 0) -> StreamingResponse:
    return event_stream(request, _fleet(request), after_seq)


@router.post("/events", **INGEST_ROUTE)
async def ingest(request: Request) -> IngestResult:
    """The batch stored, not yet folded: the workers fold it from the store. Its `cursor` is the store's cursor
    of its last event (or, all of them stored before, the store's last cursor then); it is folded once
    /readyz's cursor reaches it."""
    fleet = _fleet(request)
    with failure_recorded(fleet):
        events, appended = await ingested(request, fleet.settings, fleet.append_ingested)
    if appended is None:  # nothing in the batch: nothing to wait for
        return ingest_result(events, appended, fleet.told_through())
    return ingest_result(events, appended, appended.inserted[-1][0] if appended.inserted else appended.after_cursor)


@router.post("/replay", **REPLAY_ROUTE)
async def replay(
    request: Request, until_seq: UntilSeq = None, until_ts: UntilTs = None, limit: ReplayLimit = 100
) -> ReplayOut:
    return await replayed(request, _fleet(request), until_seq, until_ts, limit)


@router.get("/audit", response_model=AuditOut, summary="Findings at `now`, merged from the partition workers")
async def get_audit(
    request: Request,
    now: Now = None,
    code: Annotated[FindingCode | None, Query()] = None,
    limit: Annotated[int, Query(ge=1, le=1 << 30)] = 100,
) -> AuditOut | Response:
    fleet = _fleet(request)
    check_limit(fleet, limit)
    if now is None:
        audited = await fleet.audited_at(None)
        answers: PublishedAnswers = request.app.state.published_answers
        return answers.answer(audited, code, limit)
    at, findings, counts, _ = await fleet.findings_at(now)
    return audit_out(at, findings, counts, code, limit)


@router.get("/audit/summary", response_model=AuditSummary, summary="Counts, holdings, latencies, timeout advice")
async def get_summary(request: Request, now: Now = None) -> AuditSummary:
    fleet = _fleet(request)
    return summary(fleet, await fleet.audited_at(now))


router.add_api_route(
    "/metrics", health.metrics, methods=["GET"], response_class=Response,
    summary="Prometheus metrics (text exposition format): those that derive from the fold, merged",
)  # fmt: skip


@router.get("/transfers", response_model=TransferPage, summary="Transfer sides, by their first event's cursor")
async def list_transfers(
    request: Request,
    phase: PhaseName | None = None,
    source: SourceFilter = None,
    request_id: RequestIdFilter = None,
    mode: ModeFilter = None,
    has_finding: HasFindingFilter = None,
    now: Now = None,
    cursor: Cursor = 0,
    limit: Limit = 100,
) -> TransferPage:
    fleet = _fleet(request)
    check_limit(fleet, limit)
    keys = (await fleet.findings_at(now))[3] if has_finding is not None else None
    asked = SidesAsked(cursor, limit, phase, source, mode, request_id, None, has_finding, SCAN_SIDES_MAX)
    page, next_cursor = await fleet.sides(asked, keys)
    return TransferPage(transfers=[transfer_out(t) for t in page], next_cursor=next_cursor)


@router.get("/transfers/{transfer_id}", response_model=TransferDetail, responses={404: {"description": "unseen"}})
async def get_transfer(request: Request, transfer_id: TransferIdPath, now: Now = None) -> TransferDetail:
    fleet = _fleet(request)

    async def findings() -> list[Finding]:
        return (await fleet.findings_at(now))[1]

    return await transfer_detail(request.app.state.transfers, transfer_id, fleet.settings.timeline_events_max, findings)


@router.get("/requests/{request_id}", response_model=RequestDetail, responses={404: {"description": "no map names it"}})
async def get_request(request: Request, request_id: RequestIdPath) -> RequestDetail:
    sides = await _fleet(request).request(request_id)
    if sides is None:
        raise HTTPException(404, f"no map event names request id {request_id!r}")
    return RequestDetail(request_id=request_id, sides=[transfer_out(t) for t in sides])


@router.get("/fleet/answers", summary="This service's partitions' answers at `now` (msgpack), for a merge")
async def fleet_answers(request: Request, now: Annotated[float, Query(ge=0)]) -> Response:
    fleet = _fleet(request)
    found: list[PartitionAnswer] = await fleet.answers(now)
    return Response(
        msgspec.msgpack.encode(found), media_type="application/msgpack",
        headers={"Kvledger-Partitions": str(fleet.partitions)},
    )  # fmt: skip


@router.get("/fleet/status", summary="Per owned partition: events folded, complete through, applied, restored from")
async def fleet_status(request: Request) -> dict[str, object]:
    fleet = _fleet(request)
    return {
        "partitions": fleet.partitions,
        "owned": fleet.owned,
        "workers": [{"partitions": w.partitions, "pid": w.process.pid} for w in fleet.workers],
        "restarts": fleet.restarts,
        "folded": {
            str(p): {"events": v[0], "upto": v[1], "applied": v[2], "restored": v[3]}
            for p, v in (await fleet.status()).items()
        },
        "published_events": fleet.audited.events if fleet.audited is not None else 0,
    }


def create_fleet_app(settings: Settings, partitions: str, *, service: str, workers: int | None = None) -> FastAPI:
    """The API over `partitions` of the stream at `settings.db`, folded by worker processes."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        fleet = Fleet(settings, partitions, service=service, workers=workers)
        app.state.fleet = fleet
        await fleet.open()
        app.state.board, app.state.trust = FleetBoards(fleet), FleetTrust(fleet)
        app.state.transfers = FleetTransfers(fleet)
        app.state.registry = fleet_registry(fleet)
        # As the one-process service (api/app.py): what startup made lives as long as the service; the
        # collector's full passes need not walk it (the folds themselves live in the workers).
        gc.collect()
        gc.freeze()
        # As the one-process service: a request waits at most this long on each hand-over of the GIL from the
        # merge's thread, not CPython's 5 ms.
        switch_interval_s = sys.getswitchinterval()
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        try:
            yield
        finally:
            sys.setswitchinterval(switch_interval_s)
            await fleet.close()

    app = FastAPI(title="kvledger audit service (partition workers)", version="1", lifespan=lifespan)
    app.state.settings = settings
    app.state.published_answers = PublishedAnswers()
    app.state.templates = Jinja2Templates(directory=Path(__file__).parent / "templates")
    errors.install(app)

    @app.exception_handler(WorkerLost)
    async def worker_lost(request: Request, error: WorkerLost) -> Response:
        return JSONResponse({"detail": f"{error}; ask again"}, status_code=503, headers={"Retry-After": "1"})

    app.include_router(router)
    app.include_router(web.router)
    return app
