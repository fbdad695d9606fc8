"""The web page for an SRE at 3 a.m.: what is wrong first (or why the page cannot vouch), lost engines apart
from leaks, plots, findings grouped and paged, and a transfer's timeline in words and SVG."""

from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import HTMLResponse
from fastapi.templating import Jinja2Templates

from kvledger.api.board import Board, BoardKeeper
from kvledger.api.limits import FINDINGS_PAGE_ROWS, GROUP_ROWS_SHOWN, GROUPS_SHOWN_MAX
from kvledger.api.params import Now, TransferIdPath
from kvledger.api.settings import Settings
from kvledger.api.timeline_view import lay_out
from kvledger.api.transfer_events import Transfers
from kvledger.api.trust import TrustChecks
from kvledger.api.verdict import activity, headline, verdict
from kvledger.api.views import display_url
from kvledger.ledger import humanize
from kvledger.ledger.audit import CODES
from kvledger.ledger.sources import silence_limit_s

router = APIRouter(include_in_schema=False)

Offset = Annotated[int, Query(ge=0, le=1 << 40, description="Rows to skip (a page's offset)")]


def _templates(request: Request) -> Jinja2Templates:
    templates: Jinja2Templates = request.app.state.templates
    return templates


def _settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


async def _board(request: Request, now: float | None) -> Board:
    keeper: BoardKeeper = request.app.state.board
    return await (keeper.at(now) if now is not None else keeper.current())


def _common(settings: Settings, board: Board) -> dict[str, Any]:
    """What every page's header and helpers need: the store, the audit time, the formatters."""
    wall = time.time()
    return {
        "board": board,
        "store": display_url(settings.db),
        "wall": wall,
        "codes": CODES,
        "duration": humanize.duration,
        "utc": humanize.utc,
        "iso": humanize.iso,
        "ago": humanize.ago,
        # Links keep an asked-for audit time, so paging through a time-travel audit stays in it.
        "now_query": f"&now={board.now!r}" if board.explicit else "",
        "now_param": f"?now={board.now!r}" if board.explicit else "",
    }


@router.get("/", response_class=HTMLResponse)
async def index(request: Request, now: Now = None) -> HTMLResponse:
    trust: TrustChecks = request.app.state.trust
    problems = await trust.problems()
    board = await _board(request, now)
    settings = _settings(request)
    context = _common(settings, board)
    newest = board.newest_ts
    quiet_s = context["wall"] - newest if newest is not None else None
    if quiet_s is not None and quiet_s <= silence_limit_s(settings.transfer_timeout_s):
        quiet_s = None  # written to lately: the cluster is running
    context |= {
        "problems": problems,
        "head": headline(board, problems),
        "lines": verdict(board, problems),
        "activity": activity(board, problems),
        "quiet_s": quiet_s,
        "live_groups": board.live_groups[:GROUPS_SHOWN_MAX],
        "lost_groups": board.lost_groups[:GROUPS_SHOWN_MAX],
        "rows_shown": GROUP_ROWS_SHOWN,
    }
    return _templates(request).TemplateResponse(request, "index.html", context)


@router.get("/ui/findings", response_class=HTMLResponse)
async def findings_page(
    request: Request,
    code: Annotated[str | None, Query(max_length=40)] = None,
    source: Annotated[str | None, Query(max_length=200)] = None,
    offset: Offset = 0,
    now: Now = None,
) -> HTMLResponse:
    """One group's transfers a page at a time (`code` and `source`), or every group a page at a time."""
    board = await _board(request, now)
    context = _common(_settings(request), board) | {"offset": offset, "rows": FINDINGS_PAGE_ROWS}
    if code is None and source is None:
        context |= {"groups": board.groups[offset : offset + FINDINGS_PAGE_ROWS], "total": len(board.groups)}
        return _templates(request).TemplateResponse(request, "groups.html", context)
    group = board.group(code or "", source or "")
    if group is None:
        raise HTTPException(404, f"no {code} findings on {source!r} at this audit")
    context |= {"group": group, "findings": group.findings[offset : offset + FINDINGS_PAGE_ROWS]}
    return _templates(request).TemplateResponse(request, "findings.html", context)


@router.get("/ui/transfers/{transfer_id}", response_class=HTMLResponse)
async def transfer_page(
    request: Request,
    transfer_id: TransferIdPath,
    now: Now = None,
) -> HTMLResponse:
    transfers: Transfers = request.app.state.transfers
    events_max = _settings(request).timeline_events_max
    sides = await transfers.sides(transfer_id)
    events = await transfers.events(transfer_id, events_max)
    if not sides and not events:
        raise HTTPException(404, f"no source has seen transfer id {transfer_id!r}")
    # The same audit as the front page's, so a transfer reached from it tells the same story.
    board = await _board(request, now)
    at = board.now
    findings = [f for g in board.groups for f in g.findings if f.transfer_id == transfer_id]
    health = {h.source: h for h in board.sources}
    return _templates(request).TemplateResponse(
        request,
        "transfer.html",
        {
            "transfer_id": transfer_id,
            "sides": sides,
            "findings": findings,
            "health": health,
            "view": lay_out(events, sides, at, frozenset(h.source for h in board.sources if h.lost)),
            "truncated": len(events) > events_max,
            "utc": humanize.utc,
            "duration": humanize.duration,
            "now": at,
        },
    )
