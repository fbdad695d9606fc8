"""The 1P1D proxy against two real HTTP engines on loopback (a stand-in pair that records what it is sent):
the prefill is asked for one token, both sides carry one transfer id, and the client gets the decode's answer."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from kvledger.proxy.app import KvAddress, ProxySettings, create_app

START_POLLS_MAX = 1000
PREFILL_WAIT_S = 30.0
"""The WRITE decode waits for the prefill to arrive, as a real decode waits for pushed KV; a bound, not a timing."""


class Engines:
    """A prefill and a decode engine in one loopback server (`/p`, `/d`), each recording the bodies it got."""

    def __init__(self) -> None:
        self.prefilled: list[dict[str, Any]] = []
        self.decoded: list[dict[str, Any]] = []
        self.app = FastAPI()
        prefill_arrived = asyncio.Event()

        @self.app.post("/p/v1/completions")
        async def prefill(request: Request) -> dict[str, Any]:
            body: dict[str, Any] = await request.json()
            self.prefilled.append(body)
            prefill_arrived.set()
            return {"choices": [{"text": "x"}], "kv_transfer_params": {"from": "prefill", **body["kv_transfer_params"]}}

        @self.app.post("/d/v1/completions")
        async def decode(request: Request) -> dict[str, Any]:
            body: dict[str, Any] = await request.json()
            self.decoded.append(body)
            if body["kv_transfer_params"].get("do_remote_prefill"):
                await asyncio.wait_for(prefill_arrived.wait(), PREFILL_WAIT_S)
            return {"choices": [{"text": "decoded"}]}

    @staticmethod
    @contextmanager
    def serve(app: FastAPI) -> Iterator[str]:
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        for _ in range(START_POLLS_MAX):
            if server.started or not thread.is_alive():
                break
            thread.join(0.01)
        assert server.started, "uvicorn did not start"
        try:
            yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
        finally:
            server.should_exit = True
            thread.join()


@pytest.fixture
def engines() -> Iterator[tuple[Engines, str]]:
    pair = Engines()
    with Engines.serve(pair.app) as base:
        yield pair, base


def test_read_mode_prefills_one_token_then_decodes_with_the_producers_params(engines: tuple[Engines, str]) -> None:
    pair, base = engines
    with TestClient(create_app(ProxySettings(f"{base}/p", f"{base}/d", mode="read"))) as client:
        answer = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 9, "stream_options": {}})
    assert answer.status_code == 200 and answer.json() == {"choices": [{"text": "decoded"}]}
    [prefilled], [decoded] = pair.prefilled, pair.decoded
    assert prefilled["max_tokens"] == 1 and prefilled["stream"] is False and "stream_options" not in prefilled
    tid = prefilled["kv_transfer_params"]["transfer_id"]
    assert tid.startswith("tx-") and prefilled["kv_transfer_params"]["do_remote_decode"] is True
    assert decoded["max_tokens"] == 9
    assert decoded["kv_transfer_params"] == {"from": "prefill", "do_remote_decode": True, "transfer_id": tid}


def test_write_mode_tells_each_side_the_others_ports_under_one_transfer_id(engines: tuple[Engines, str]) -> None:
    pair, base = engines
    settings = ProxySettings(
        f"{base}/p", f"{base}/d", mode="write",
        prefill_kv=KvAddress.parse("127.0.0.1:7100:7200"), decode_kv=KvAddress.parse("127.0.0.2:7101:7201"),
    )  # fmt: skip
    with TestClient(create_app(settings)) as client:
        answer = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
    assert answer.status_code == 200 and answer.json() == {"choices": [{"text": "decoded"}]}
    [prefilled], [decoded] = pair.prefilled, pair.decoded
    to_prefill, to_decode = prefilled["kv_transfer_params"], decoded["kv_transfer_params"]
    assert to_prefill["transfer_id"] == to_decode["transfer_id"]
    assert (to_prefill["remote_host"], to_prefill["remote_handshake_port"]) == ("127.0.0.2", 7101)
    assert (to_decode["remote_host"], to_decode["remote_notify_port"]) == ("127.0.0.1", 7200)


def test_write_mode_needs_both_kv_addresses() -> None:
    with pytest.raises(ValueError, match="--prefill-kv and --decode-kv"):
        ProxySettings("http://p", "http://d", mode="write", prefill_kv=KvAddress.parse("h:1:2"))
