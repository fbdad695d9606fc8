"""`kvledger serve`: run the audit service (FastAPI under uvicorn) over a store."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from kvledger.api.settings import Settings


def parse_dead(values: list[str]) -> dict[str, str]:
    """`["prefill-0=killed by the storm", "decode-1"]` -> `{"prefill-0": "killed by the storm", "decode-1": ""}`."""
    dead: dict[str, str] = {}
    for value in values:
        engine, _, why = value.partition("=")
        if not engine.strip():
            raise typer.BadParameter(f"{value!r} names no engine", param_hint="--dead")
        dead[engine.strip()] = why.strip()
    return dead


def service_settings(
    db: str,
    *,
    defer_timeout: float | None = None,
    transfer_timeout: float | None = None,
    dead: dict[str, str] | None = None,
) -> Settings:
    """The settings `serve` runs with (also what the demo's browser tests start the service with)."""
    from kvledger.api.settings import Settings

    settings = Settings(db=db)
    if defer_timeout is not None:
        settings = settings.model_copy(update={"defer_timeout_s": defer_timeout})
    if transfer_timeout is not None:
        settings = settings.model_copy(update={"transfer_timeout_s": transfer_timeout})
    if dead:
        settings = settings.model_copy(update={"dead_engines": settings.dead_engines | dead})
    return settings


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
    dead: Annotated[
        list[str] | None,
        typer.Option(help="An engine known dead, optionally =why (repeat): what it held is lost, not leaked"),
    ] = None,
    partitions: Annotated[
        str | None,
        typer.Option(
            help="Fold these partitions of the store (0-7, 0,2,5-6, all; a SQL store has 16) in worker processes, "
            "each from its durable consumer (nats://) or the store's tail (sqlite, postgresql), and serve the audit "
            "API, metrics and page merged from them (docs/fleet.md)"
        ),
    ] = None,
    service_name: Annotated[
        str, typer.Option("--service", help="With --partitions: names the durable consumers and snapshots")
    ] = "kvledger",
    workers: Annotated[
        int | None, typer.Option(min=1, help="With --partitions: worker processes (default: the cores)")
    ] = None,
) -> None:
    """Serve the audit API, metrics and web page over the store at --db (ingest token: KVLEDGER_TOKEN)."""
    settings = service_settings(
        db, defer_timeout=defer_timeout, transfer_timeout=transfer_timeout, dead=parse_dead(dead or [])
    )
    if partitions is not None:
        run_fleet(settings, partitions, service=service_name, workers=workers, host=host, port=port)
        return
    run_service(settings, host=host, port=port)


def run_fleet(settings: Settings, partitions: str, *, service: str, workers: int | None, host: str, port: int) -> None:
    """uvicorn serving the API over partition workers (`kvledger.api.fleet_app`) until Ctrl-C."""
    import uvicorn

    from kvledger.api.fleet_app import create_fleet_app
    from kvledger.api.server import server_config
    from kvledger.ledger.store.base import StoreError
    from kvledger.ledger.store.url import parse_url

    try:
        in_memory = parse_url(settings.db).is_memory
    except StoreError:
        in_memory = False  # the service's start says what is wrong with it
    if in_memory:
        raise typer.BadParameter(
            "--partitions needs a store the worker processes share: nats://, sqlite:/// or postgresql://",
            param_hint="--partitions",
        )
    app = create_fleet_app(settings, partitions, service=service, workers=workers)
    uvicorn.Server(server_config(app, settings, host=host, port=port)).run()


def run_service(settings: Settings, *, host: str, port: int) -> None:
    """uvicorn serving `create_app(settings)` until Ctrl-C (`serve`, and the demo once its storm is done)."""
    # Imported here: the web stack loads only for this command, not for every `kvledger` call,
    # and the ledger package itself never depends on the service.
    import uvicorn

    from kvledger.api.app import create_app
    from kvledger.api.server import server_config

    # The limits on what one client may hold (header and body time, header size, connections) are the
    # settings' (KVLEDGER_* variables); api/server.py says which mechanism applies each.
    uvicorn.Server(server_config(create_app(settings), settings, host=host, port=port)).run()
