"""The store's event tail (a page, or a live Server-Sent Events stream) and the ingest endpoint.

The tail and the batch's reading are the same for the service over partition workers (`kvledger.api.fleet_app`),
which reads the tail from its own `Fleet`: what both read of a service is `Tailed`."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Annotated, Any, Protocol

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import StreamingResponse

from kvledger.api.deps import LiveDep, StoreDep, require_token
from kvledger.api.errors import read_limited
from kvledger.api.ingest import decode_batch, find_gaps
from kvledger.api.params import check_limit
from kvledger.api.schemas import EventPage, EventRow, IngestResult
from kvledger.api.settings import Settings
from kvledger.api.views import event_json
from kvledger.api.waits import wait_set
from kvledger.ledger.events import Event
from kvledger.ledger.store.base import Appended, StoreError

router = APIRouter(tags=["events"])

AfterSeq = Annotated[int, Query(ge=0, le=1 << 62, description="Store-wide cursor to read after (0: the start)")]
HEARTBEAT_S = 15.0
"""A comment line this often keeps proxies from closing an idle stream."""


class Tailed(Protocol):
    """What the event tail reads of a service."""

    settings: Settings
    streams_open: int

    @property
    def store(self) -> Any: ...  # an EventStore, or None while the store is down

    @property
    def advanced(self) -> asyncio.Event:
        """Set (and replaced) when the store may hold events a stream has not read."""

    async def store_call(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any: ...


@router.get("/events", response_model=EventPage, summary="Events after a store-wide cursor")
async def tail(
    live: LiveDep,
    store: StoreDep,  # 503 while the store is down
    after_seq: AfterSeq = 0,
    limit: Annotated[int, Query(ge=1, le=1 << 30)] = 100,
) -> EventPage:
    return await tail_page(live, after_seq, limit)


async def tail_page(service: Tailed, after_seq: int, limit: int) -> EventPage:
    """GET /events' answer: at most `limit` stored events after `after_seq`."""
    check_limit(service, limit)
    rows = await service.store_call(service.store.tail, after_seq, limit)
    return EventPage(
        events=[EventRow(cursor=cursor, event=event_json(e)) for cursor, e in rows],
        next_after_seq=rows[-1][0] if rows else after_seq,
    )


async def _stream(request: Request, service: Tailed, after_seq: int) -> AsyncIterator[str]:
    """SSE frames of stored events from `after_seq` on; ends on disconnect or after the duration limit."""
    service.streams_open += 1
    try:
        async for frame in _frames(request, service, after_seq):
            yield frame
    finally:
        service.streams_open -= 1


async def _frames(request: Request, service: Tailed, after_seq: int) -> AsyncIterator[str]:
    cursor = after_seq
    deadline = time.monotonic() + service.settings.stream_duration_max_s
    batch = service.settings.tail_batch_max
    while time.monotonic() < deadline and not await request.is_disconnected():
        waiter = service.advanced
        store = service.store
        try:
            rows = await service.store_call(store.tail, cursor, batch) if store is not None else []
        except StoreError as error:
            # A store that failed one read is no reason to end a follower's stream: said in a comment, and read
            # again on the next wake or heartbeat, from the same cursor.
            yield f": the store did not answer: {type(error).__name__}\n\n"
            rows = []
        for row_cursor, event in rows:
            yield f"id: {row_cursor}\nevent: event\ndata: {json.dumps(event_json(event))}\n\n"
            cursor = row_cursor
        if len(rows) == batch:
            continue
        if not await wait_set(waiter, min(HEARTBEAT_S, max(0.0, deadline - time.monotonic()))):
            yield ": heartbeat\n\n"


STREAM_ROUTE: dict[str, Any] = {
    "summary": "Live follow: Server-Sent Events from a cursor (bounded; ends when the client goes)",
    "response_class": StreamingResponse,
    "responses": {200: {"content": {"text/event-stream": {"schema": {"type": "string"}}}}},
}
"""GET /events/stream's declaration, the one-process service's and the partition workers' (`fleet_app`)."""


@router.get("/events/stream", **STREAM_ROUTE)
async def stream(request: Request, live: LiveDep, after_seq: AfterSeq = 0) -> StreamingResponse:
    return event_stream(request, live, after_seq)


def event_stream(request: Request, service: Tailed, after_seq: int) -> StreamingResponse:
    """GET /events/stream's answer: the stream of `service`'s stored events after `after_seq`."""
    return StreamingResponse(
        _stream(request, service, after_seq),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
    )


INGEST_ROUTE: dict[str, Any] = {
    "response_model": IngestResult,
    "summary": "Ingest a batch from a remote appender (bearer token; idempotent by source and seq)",
    "dependencies": [Depends(require_token)],
    "openapi_extra": {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/IngestBatch"}}},
        }
    },
    "responses": {
        401: {"description": "No bearer token"},
        403: {"description": "Wrong token, or ingest disabled"},
        409: {"description": "A (source, seq) is stored with different content; nothing written"},
        413: {"description": "Body too large"},
    },
}
"""POST /events' declaration, the one-process service's and the partition workers' (`fleet_app`)."""


async def ingested(
    request: Request, settings: Settings, append: Callable[[list[Event]], Awaitable[Appended]]
) -> tuple[list[Event], Appended | None]:
    """The request's batch read (at most `ingest_body_bytes_max`), checked, and appended by `append`."""
    body = b"".join([chunk async for chunk in read_limited(request, settings.ingest_body_bytes_max)])
    events = decode_batch(body, settings.ingest_events_max)
    return events, (await append(events) if events else None)


def ingest_result(events: list[Event], appended: Appended | None, cursor: int) -> IngestResult:
    """POST /events' answer for `events`, of which `appended` stored what it inserted."""
    inserted = len(appended.inserted) if appended is not None else 0
    return IngestResult(
        received=len(events),
        inserted=inserted,
        duplicates=len(events) - inserted,
        gaps=find_gaps(events, appended.stored_max if appended is not None else {}),
        cursor=cursor,
    )


@router.post("/events", **INGEST_ROUTE)
async def ingest(request: Request, live: LiveDep, store: StoreDep) -> IngestResult:
    with failure_recorded(live):
        events, appended = await ingested(request, live.settings, lambda batch: live.append_ingested(store, batch))
        # Folded on the event loop while the next batch's insert runs on the ingest thread (its driver off the
        # GIL). Cursor order is kept by `fold_appended`.
        await live.fold_appended(appended)
    return ingest_result(events, appended, live.cursor)


class Ingesting(Protocol):
    ingest_failure: tuple[float, str] | None
    """(when, why) the last POST /events stored nothing; None once one stored its batch."""


@contextmanager
def failure_recorded(service: Ingesting) -> Iterator[None]:
    """Whatever refused the batch (a bad body, a conflict, a store down), its events are not in the ledger:
    recorded, the page says ingest is failing until a batch is stored again."""
    try:
        yield
    except Exception as error:
        detail = getattr(error, "detail", None)
        service.ingest_failure = (
            time.time(),
            f"{type(error).__name__}: {str(detail if detail is not None else error)[:300]}",
        )
        raise
    service.ingest_failure = None
