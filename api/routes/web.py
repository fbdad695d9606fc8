"""The web page for an SRE at 3 a.m.: the worst problems first, and a transfer's timeline in words and SVG."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import HTMLResponse
from fastapi.templating import Jinja2Templates

from api import timeline
from api.deps import LiveDep, StoreDep
from api.routes.audit import get_summary
from api.routes.transfers import Now, TransferIdPath, _timeline
from ledger.audit import CODES
from ledger.events import TransferId

FINDINGS_SHOWN_MAX = 200
"""Rows on the front page; the JSON API pages through the rest."""

router = APIRouter(include_in_schema=False)


def _templates(request: Request) -> Jinja2Templates:
    templates: Jinja2Templates = request.app.state.templates
    return templates


@router.get("/", response_class=HTMLResponse)
async def index(request: Request, live: LiveDep, now: Now = None) -> HTMLResponse:
    summary = await get_summary(live, now)
    findings = live.findings(summary.now)
    return _templates(request).TemplateResponse(
        request,
        "index.html",
        {
            "summary": summary,
            "findings": findings[:FINDINGS_SHOWN_MAX],
            "findings_total": len(findings),
            "codes": CODES,
            "clock": timeline.clock,
            "store_error": live.store_error,
            "quarantined": live.quarantined,
        },
    )


@router.get("/ui/transfers/{transfer_id}", response_class=HTMLResponse)
async def transfer_page(
    request: Request,
    live: LiveDep,
    store: StoreDep,
    transfer_id: TransferIdPath,
    now: Now = None,
) -> HTMLResponse:
    at = now if now is not None else live.clock_now()
    state = live.state
    sides = [t for s in state.sources if (t := state.transfers.get((s, TransferId(transfer_id)))) is not None]
    events = await live.store_call(_timeline, store, transfer_id, live.settings.timeline_events_max)
    if not sides and not events:
        raise HTTPException(404, f"no source has seen transfer id {transfer_id!r}")
    findings = [f for f in live.findings(at) if f.transfer_id == transfer_id]
    return _templates(request).TemplateResponse(
        request,
        "transfer.html",
        {
            "transfer_id": transfer_id,
            "sides": sides,
            "findings": findings,
            "view": timeline.build(events, sides, at),
            "truncated": len(events) > live.settings.timeline_events_max,
            "clock": timeline.clock,
            "now": at,
        },
    )
