"""Transfers as the fold derived them: a filtered, paginated list; one transfer with its timeline."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from fastapi import APIRouter, HTTPException, Request

from kvledger.api.deps import LiveDep
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
from kvledger.api.schemas import RequestDetail, TransferDetail, TransferOut, TransferPage
from kvledger.api.transfer_events import Transfers
from kvledger.api.views import event_json, findings_of, transfer_out
from kvledger.ledger.audit import Finding
from kvledger.ledger.decisions import Key
from kvledger.ledger.lifecycle import PhaseName
from kvledger.ledger.side import TransferState

SCAN_SIDES_MAX = 100_000
"""Transfer sides one page request looks at; a rare filter returns a short page and a cursor, not a stall."""

router = APIRouter(tags=["transfers"])


@router.get("/transfers", response_model=TransferPage, summary="Transfer sides, filtered, oldest first")
async def list_transfers(
    live: LiveDep,
    phase: PhaseName | None = None,
    source: SourceFilter = None,
    request_id: RequestIdFilter = None,
    mode: ModeFilter = None,
    has_finding: HasFindingFilter = None,
    now: Now = None,
    cursor: Cursor = 0,
    limit: Limit = 100,
) -> TransferPage:
    check_limit(live, limit)
    keys: Sequence[Key] = live.by_request.get(request_id, ()) if request_id is not None else live.order
    flagged = live.keys_with_findings(now) if has_finding is not None else None
    transfers = live.state.transfers
    page: list[TransferOut] = []
    position = cursor
    end = min(len(keys), cursor + SCAN_SIDES_MAX)
    while position < end and len(page) < limit:
        key = keys[position]
        position += 1
        t = transfers.get(key)
        if t is None or not _matches(t, phase, source, mode):
            continue
        if flagged is not None and (key in flagged) != has_finding:
            continue
        page.append(transfer_out(t))
    return TransferPage(transfers=page, next_cursor=position if position < len(keys) else None)


def _matches(t: TransferState, phase: PhaseName | None, source: str | None, mode: str | None) -> bool:
    return (
        (phase is None or t.phase == phase)
        and (source is None or t.source == source)
        and (mode is None or t.mode == mode)
    )


@router.get(
    "/transfers/{transfer_id}",
    response_model=TransferDetail,
    summary="Every side of one transfer id, its findings and its full event timeline",
    responses={404: {"description": "No source has seen this transfer id"}},
)
async def get_transfer(request: Request, live: LiveDep, transfer_id: TransferIdPath, now: Now = None) -> TransferDetail:
    async def findings() -> list[Finding]:
        return live.findings_at(now)[1]

    return await transfer_detail(request.app.state.transfers, transfer_id, live.settings.timeline_events_max, findings)


async def transfer_detail(
    transfers: Transfers, transfer_id: str, events_max: int, findings_at: Callable[[], Awaitable[list[Finding]]]
) -> TransferDetail:
    """`GET /transfers/{id}` over `transfers` (the one-process service's fold and store, or the partition
    workers'): 404 where no side and no event names the id, else its sides, findings (`findings_at`, asked only
    then) and timeline."""
    sides = await transfers.sides(transfer_id)
    timeline = await transfers.events(transfer_id, events_max)
    if not sides and not timeline:
        raise HTTPException(404, f"no source has seen transfer id {transfer_id!r}")
    return TransferDetail(
        transfer_id=transfer_id,
        sides=[transfer_out(t) for t in sides],
        findings=findings_of(await findings_at(), transfer_id),
        timeline=[event_json(e) for e in timeline[:events_max]],
        timeline_truncated=len(timeline) > events_max,
    )


@router.get(
    "/requests/{request_id}",
    response_model=RequestDetail,
    summary="The transfer sides a local request id was mapped to",
    responses={404: {"description": "No map event names this request id"}},
)
async def get_request(live: LiveDep, request_id: RequestIdPath) -> RequestDetail:
    keys = live.by_request.get(request_id)
    if not keys:
        raise HTTPException(404, f"no map event names request id {request_id!r}")
    sides = [transfer_out(live.state.transfers[key]) for key in keys if key in live.state.transfers]
    return RequestDetail(request_id=request_id, sides=sides)
