"""`kvledger proxy`: the 1P1D front (proxy/app.py) under uvicorn."""

from __future__ import annotations

from typing import Annotated

import typer


def proxy(
    prefill: Annotated[str, typer.Option(help="The prefill (kv_producer) server's base URL")],
    decode: Annotated[str, typer.Option(help="The decode (kv_consumer) server's base URL")],
    mode: Annotated[
        str, typer.Option(help="read (decode pulls) or write (prefill pushes); as the engines' read_mode")
    ] = "read",
    prefill_kv: Annotated[
        str | None, typer.Option(help="WRITE: the prefill engine's connector, host:handshake_port:notify_port")
    ] = None,
    decode_kv: Annotated[
        str | None, typer.Option(help="WRITE: the decode engine's connector, host:handshake_port:notify_port")
    ] = None,
    host: Annotated[str, typer.Option(help="Address to bind; loopback unless you mean to expose it")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="TCP port")] = 8000,
) -> None:
    """Serve /v1/completions: each request is prefilled on --prefill and decoded on --decode."""
    # Imported here: the web stack loads only for this command.
    import uvicorn

    from kvledger.proxy.app import KvAddress, ProxySettings, create_app

    settings = ProxySettings(
        prefill_url=prefill.rstrip("/"),
        decode_url=decode.rstrip("/"),
        mode=mode,
        prefill_kv=KvAddress.parse(prefill_kv) if prefill_kv else None,
        decode_kv=KvAddress.parse(decode_kv) if decode_kv else None,
    )
    uvicorn.run(create_app(settings), host=host, port=port, log_level="info")


if __name__ == "__main__":
    typer.run(proxy)
