"""Online 1P1D: two real OpenAI servers (prefill and decode) behind `kvledger proxy`, an OpenAI-style client.

The same commands as the README's recipe. The proxied answer (plain and streamed)
must equal the prefill server's own non-disaggregated answer, the ledgers must
show a completed transfer per request, and two prompts must answer differently
(or equality would say nothing).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvledger.connector.ports import free_loopback_ports
from tests.e2e.harness import allocate_ports, ledger_extra, ledger_transfer_config, prompts
from tests.e2e.ledger_check import assert_clean, fold_logs
from tests.e2e.servers import proxy_command, servers, vllm_serve_command

pytestmark = pytest.mark.vllm

REQUEST_TIMEOUT_S = 120.0
PREFILL_CPU, DECODE_CPU = ("0", "1") if (os.cpu_count() or 1) >= 2 else ("", "")


def _completion(url: str, body: dict[str, Any]) -> list[int]:
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S)
    assert response.status_code == 200, response.text
    tokens: list[int] = response.json()["choices"][0]["token_ids"]
    return tokens


def _streamed(url: str, body: dict[str, Any]) -> list[int]:
    tokens: list[int] = []
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=REQUEST_TIMEOUT_S) as s:
        assert s.status_code == 200
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                tokens.extend(json.loads(line[len("data: ") :])["choices"][0]["token_ids"] or [])
    return tokens


@pytest.mark.parametrize("mode", ["read", "write"])
def test_proxy_serves_1p1d_token_equal(mode: str, tiny_model: str, tmp_path: Path) -> None:
    pp, cp = allocate_ports()
    prefill_port, decode_port, proxy_port = free_loopback_ports(3)
    logs = tmp_path / "logs"
    prefill = vllm_serve_command(
        tiny_model, prefill_port, ledger_transfer_config("kv_producer", "prefill-0", ledger_extra(mode, pp, cp, logs))
    )
    decode = vllm_serve_command(
        tiny_model, decode_port, ledger_transfer_config("kv_consumer", "decode-0", ledger_extra(mode, cp, pp, logs))
    )
    kv = (
        [
            "--prefill-kv",
            f"127.0.0.1:{pp.handshake}:{pp.notify}",
            "--decode-kv",
            f"127.0.0.1:{cp.handshake}:{cp.notify}",
        ]
        if mode == "write"
        else []
    )
    proxy = proxy_command(proxy_port, prefill_port, decode_port, mode, kv)
    first, second = prompts(2)
    with servers(
        (prefill, prefill_port, tmp_path / "prefill.log", PREFILL_CPU),
        (decode, decode_port, tmp_path / "decode.log", DECODE_CPU),
        (proxy, proxy_port, tmp_path / "proxy.log", ""),
    ):
        body = {"model": tiny_model, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
        plain = [_completion(f"http://127.0.0.1:{prefill_port}", {**body, "prompt": p}) for p in (first, second)]
        assert plain[0] != plain[1]
        proxy_url = f"http://127.0.0.1:{proxy_port}"
        assert [_completion(proxy_url, {**body, "prompt": p}) for p in (first, second)] == plain
        assert _streamed(proxy_url, {**body, "prompt": first}) == plain[0]
    folded = fold_logs(logs)
    assert folded.causes("decode-0") == {"completed": 3 * 2}  # three requests, scheduler and worker sides
    assert_clean(folded)
