"""The store's event tail (a page, or a live Server-Sent Events stream) and the ingest endpoint."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import StreamingResponse

from kvledger.api.deps import LiveDep, StoreDep, require_token
from kvledger.api.errors import read_limited
from kvledger.api.ingest import decode_batch, find_gaps
from kvledger.api.live import Live
from kvledger.api.params import check_limit
from kvledger.api.schemas import EventPage, EventRow, IngestResult
from kvledger.api.views import event_json
from kvledger.api.waits import wait_set

router = APIRouter(tags=["events"])

AfterSeq = Annotated[int, Query(ge=0, le=1 << 62, description="Store-wide cursor to read after (0: the start)")]
HEARTBEAT_S = 15.0
"""A comment line this often keeps proxies from closing an idle stream."""


@router.get("/events", response_model=EventPage, summary="Events after a store-wide cursor")
async def tail(
    live: LiveDep,
    store: StoreDep,
    after_seq: AfterSeq = 0,
    limit: Annotated[int, Query(ge=1, le=1 << 30)] = 100,
) -> EventPage:
    check_limit(live, limit)
    rows = await live.store_call(store.tail, after_seq, limit)
    return EventPage(
        events=[EventRow(cursor=cursor, event=event_json(e)) for cursor, e in rows],
        next_after_seq=rows[-1][0] if rows else after_seq,
    )


async def _stream(request: Request, live: Live, after_seq: int) -> AsyncIterator[str]:
    """SSE frames of stored events from `after_seq` on; ends on disconnect or after the duration limit."""
    live.streams_open += 1
    try:
        async for frame in _frames(request, live, after_seq):
            yield frame
    finally:
        live.streams_open -= 1


async def _frames(request: Request, live: Live, after_seq: int) -> AsyncIterator[str]:
    cursor = after_seq
    deadline = time.monotonic() + live.settings.stream_duration_max_s
    batch = live.settings.tail_batch_max
    while time.monotonic() < deadline and not await request.is_disconnected():
        waiter = live.advanced
        store = live.store
        rows = await live.store_call(store.tail, cursor, batch) if store is not None else []
        for row_cursor, event in rows:
            yield f"id: {row_cursor}\nevent: event\ndata: {json.dumps(event_json(event))}\n\n"
            cursor = row_cursor
        if len(rows) == batch:
            continue
        if not await wait_set(waiter, min(HEARTBEAT_S, max(0.0, deadline - time.monotonic()))):
            yield ": heartbeat\n\n"


@router.get(
    "/events/stream",
    summary="Live follow: Server-Sent Events from a cursor (bounded; ends when the client goes)",
    response_class=StreamingResponse,
    responses={200: {"content": {"text/event-stream": {"schema": {"type": "string"}}}}},
)
async def stream(request: Request, live: LiveDep, after_seq: AfterSeq = 0) -> StreamingResponse:
    return StreamingResponse(
        _stream(request, live, after_seq),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
    )


@router.post(
    "/events",
    response_model=IngestResult,
    summary="Ingest a batch from a remote appender (bearer token; idempotent by source and seq)",
    dependencies=[Depends(require_token)],
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/IngestBatch"}}},
        }
    },
    responses={
        401: {"description": "No bearer token"},
        403: {"description": "Wrong token, or ingest disabled"},
        409: {"description": "A (source, seq) is stored with different content; nothing written"},
        413: {"description": "Body too large"},
    },
)
async def ingest(request: Request, live: LiveDep, store: StoreDep) -> IngestResult:
    try:
        body = b"".join([chunk async for chunk in read_limited(request, live.settings.ingest_body_bytes_max)])
        events = decode_batch(body, live.settings.ingest_events_max)
        appended = await live.append_ingested(store, events) if events else None
        # Folded on the event loop while the next batch's insert runs on the ingest thread (its driver off the
        # GIL). Cursor order is kept by `fold_appended`.
        await live.fold_appended(appended)
    except Exception as error:
        # Whatever refused the batch (a bad body, a conflict, a store down), its events are not in the
        # ledger: the page says ingest is failing until a batch is stored again.
        live.ingest_failure = (time.time(), f"{type(error).__name__}: {_why(error)}")
        raise
    live.ingest_failure = None
    inserted = len(appended.inserted) if appended is not None else 0
    return IngestResult(
        received=len(events),
        inserted=inserted,
        duplicates=len(events) - inserted,
        gaps=find_gaps(events, appended.stored_max if appended is not None else {}),
        cursor=live.cursor,
    )


def _why(error: Exception) -> str:
    detail = getattr(error, "detail", None)
    return str(detail if detail is not None else error)[:300]
