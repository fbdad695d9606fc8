"""`kvledger serve`: run the audit service (FastAPI under uvicorn) over a store."""

from __future__ import annotations

from typing import Annotated

import typer


def serve(
    db: Annotated[
        str, typer.Option(envvar="KVLEDGER_DB", help="Store URL: sqlite:///path or postgresql+psycopg://...")
    ] = "sqlite:///kvledger.db",
    host: Annotated[str, typer.Option(help="Address to bind; loopback unless you mean to expose it")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="TCP port (0: any free port)")] = 8000,
    defer_timeout: Annotated[
        float | None, typer.Option(help="The connectors' defer_timeout (s), for leak advice; default 60")
    ] = None,
    transfer_timeout: Annotated[
        float | None, typer.Option(help="The connectors' transfer_timeout (s): stuck/orphan audits; default 30")
    ] = None,
) -> None:
    """Serve the audit API, metrics and web page over the store at --db (ingest token: KVLEDGER_TOKEN)."""
    # Imported here: the web stack loads only for this command, not for every `kvledger` call,
    # and the ledger package itself never depends on the service.
    import uvicorn

    from api.app import create_app
    from api.server import server_config
    from api.settings import Settings

    settings = Settings(db=db)
    if defer_timeout is not None:
        settings = settings.model_copy(update={"defer_timeout_s": defer_timeout})
    if transfer_timeout is not None:
        settings = settings.model_copy(update={"transfer_timeout_s": transfer_timeout})
    # The limits on what one client may hold (header and body time, header size, connections) are the
    # settings' (KVLEDGER_* variables); api/server.py says which mechanism applies each.
    uvicorn.Server(server_config(create_app(settings), settings, host=host, port=port)).run()
