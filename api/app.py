"""The app factory: `create_app(settings)` wires the live fold, the routers and the error handlers."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.templating import Jinja2Templates

from kvledger.api import errors, snapshots
from kvledger.api.board import BoardKeeper
from kvledger.api.event_schema import add_event_components
from kvledger.api.guards import BodyDeadline
from kvledger.api.limits import GIL_SWITCH_INTERVAL_S, frozen_at_start
from kvledger.api.live import Live
from kvledger.api.metrics import build_registry
from kvledger.api.routes import audit, events, health, replay, transfers, web
from kvledger.api.routes.audit import PublishedAnswers
from kvledger.api.settings import Settings
from kvledger.api.transfer_events import LiveTransfers
from kvledger.api.trust import TrustChecks
from kvledger.ledger.store.limits import TAIL_EVENTS_MAX


def create_app(settings: Settings | None = None) -> FastAPI:
    """A new application over the store at `settings.db`; the store is opened when the app starts."""
    settings = settings if settings is not None else Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        live = Live(
            settings,
            on_release=lambda r, latency_s: histogram.labels(r.cause).observe(latency_s),
            restore=snapshots.restore,
        )
        app.state.live = live
        # Load the whole store (from its newest snapshot on) before serving: no request sees a half-folded state.
        await live.refresh(TAIL_EVENTS_MAX)
        await live.publish_audit()  # GET /audit's first answer, before serving: requests only ever read one
        app.state.board, app.state.trust = BoardKeeper(live), TrustChecks(live)
        app.state.transfers = LiveTransfers(live)
        await app.state.board.rebuild()  # the page's first answer never waits for an audit
        # What startup built lives as long as the service: keep it out of the garbage collector's full
        # passes, which otherwise walk the whole fold and stall every request for a large ledger.
        frozen = frozen_at_start(len(live.state.transfers))
        if frozen:
            gc.collect()
            gc.freeze()
        # A request waits for the GIL on each hand-over from a busy thread (the audit, an append), several per
        # request: at most this long each, not CPython's 5 ms.
        switch_interval_s = sys.getswitchinterval()
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        tasks = [
            asyncio.create_task(live.poll_forever(), name="kvledger-poll"),
            asyncio.create_task(live.audit_forever(), name="kvledger-audit"),
        ]
        if settings.snapshot_every_events:
            tasks.append(asyncio.create_task(snapshots.write_forever(live), name="kvledger-snapshots"))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await app.state.board.close()
            if frozen:
                gc.unfreeze()
            sys.setswitchinterval(switch_interval_s)
            live.close()
            app.state.live = None

    app = FastAPI(
        title="kvledger audit service",
        version="1",
        description="Live transfers, audit findings, replay and ingest over a kvledger store.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.published_answers = PublishedAnswers()  # GET /audit's answers, serialized once each
    app.state.live = None
    registry, histogram = build_registry(lambda: app.state.live)
    app.state.registry = registry
    app.state.templates = Jinja2Templates(directory=Path(__file__).parent / "templates")
    errors.install(app)
    app.add_middleware(BodyDeadline, body_timeout_s=settings.body_timeout_s)
    for module in (health, transfers, audit, replay, events, web):
        app.include_router(module.router)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            app.openapi_schema = add_event_components(schema)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
