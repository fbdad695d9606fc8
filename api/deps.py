"""FastAPI dependencies: the live fold, the store, the settings and the ingest token check.

All `async def`: FastAPI runs a plain `def` dependency on the shared thread pool, so an endpoint
served from memory would wait for a thread whenever stalled store calls held them all."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from kvledger.api.live import Live
from kvledger.api.settings import Settings
from kvledger.ledger.store.base import EventStore

_bearer = HTTPBearer(auto_error=False, description="The token set in KVLEDGER_TOKEN")


async def get_live(request: Request) -> Live:
    live: Live = request.app.state.live
    return live


async def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


async def get_store(live: Annotated[Live, Depends(get_live)]) -> EventStore:
    if live.store is None:
        raise HTTPException(503, f"store unavailable: {live.store_error}")
    return live.store


async def require_token(
    settings: Annotated[Settings, Depends(get_settings)],
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> None:
    """401 without a bearer token, 403 with a wrong one (or when the service has none configured)."""
    if credentials is None:
        raise HTTPException(401, "a bearer token is required", headers={"WWW-Authenticate": "Bearer"})
    if settings.token is None:
        raise HTTPException(403, "ingest is disabled: the service has no token configured (KVLEDGER_TOKEN)")
    expected = settings.token.get_secret_value().encode()
    if not hmac.compare_digest(credentials.credentials.encode(), expected):
        raise HTTPException(403, "wrong token")


LiveDep = Annotated[Live, Depends(get_live)]
StoreDep = Annotated[EventStore, Depends(get_store)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
