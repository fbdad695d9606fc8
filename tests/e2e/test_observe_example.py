"""Observe mode around vLLM's in-tree `ExampleConnector` across two real CPU engines.

The producer engine saves each prompt's KV to a shared folder (ExampleConnector's
transport) and the consumer loads it. Both run LedgerConnector in observe mode;
a third engine runs ExampleConnector alone on the same folder. The observed
consumer must answer token for token as the unobserved one, the loaded KV must
matter (noise written into the folder changes the unobserved answer), and each
engine's incident log must show every transfer exactly once, with no finding in
the merged audit.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from kvledger.cli.app import app
from tests.e2e.harness import engine, engines, ledger_transfer_config, prompts, transfer_id

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _observed(role: str, engine_id: str, store: Path, logs: Path, model: str) -> dict[str, Any]:
    extra = {
        "incident_log_dir": str(logs),
        "observe": {
            "kv_connector": "ExampleConnector",
            "kv_connector_extra_config": {"shared_storage_path": str(store)},
        },
    }
    return {"model": model, "kv_transfer_config": ledger_transfer_config(role, engine_id, extra)}


def _plain(store: Path, model: str) -> dict[str, Any]:
    return {
        "model": model,
        "kv_transfer_config": {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_consumer",
            "engine_id": "decode-plain",
            "kv_connector_extra_config": {"shared_storage_path": str(store)},
        },
    }


def _noise(store: Path) -> int:
    """Overwrite every saved KV tensor with large noise; returns how many files."""
    files = sorted(store.rglob("*.safetensors"))
    for path in files:
        tensors = load_file(str(path))
        save_file({k: torch.randn_like(v) * 50 for k, v in tensors.items()}, str(path))
    return len(files)


def _events(logs: Path) -> dict[str, list[dict[str, Any]]]:
    by_source: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(logs.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if "kind" in row:
                by_source.setdefault(row["source"], []).append(row)
    return by_source


def test_observed_example_connector_is_token_equal_and_records_each_transfer_once(
    tiny_model: str, tmp_path: Path
) -> None:
    store, logs = tmp_path / "kv", tmp_path / "logs"
    batch = prompts(3, base_len=190)
    ids = [transfer_id() for _ in batch]
    with engine("prefill", _observed("kv_producer", "prefill-0", store, logs, tiny_model)) as producer:
        producer.generate(
            [
                {"prompt": p, "max_tokens": 1, "kv_transfer_params": {"transfer_id": t, "do_remote_decode": True}}
                for p, t in zip(batch, ids, strict=True)
            ]
        )
    assert list(store.rglob("*.safetensors")), "the producer saved no KV"

    consume = [
        {"prompt": p, "max_tokens": 8, "kv_transfer_params": {"transfer_id": t, "do_remote_prefill": True}}
        for p, t in zip(batch, ids, strict=True)
    ]
    with engines(
        ("decode-observed", _observed("kv_consumer", "decode-0", store, logs, tiny_model)),
        ("decode-plain", _plain(store, tiny_model)),
    ) as (observed, plain):
        got = observed.generate(consume)
        want = plain.generate([{"prompt": p, "max_tokens": 8} for p in batch])
        assert [o["tokens"] for o in got] == [o["tokens"] for o in want]
        assert all(o["num_cached_tokens"] >= 128 for o in got), got  # a whole CPU block came through the folder
        assert _noise(store) > 0
        noisy = plain.generate([{"prompt": p, "max_tokens": 8} for p in batch])
        assert [o["tokens"] for o in noisy] != [o["tokens"] for o in want]  # the loaded KV decides the answer

    events = _events(logs)
    assert set(events) == {"prefill-0/sched", "decode-0/sched"}
    for source, rows in events.items():
        maps = Counter(r["transfer_id"] for r in rows if r["kind"] == "map")
        assert maps == Counter(ids), (source, maps)
        decided = Counter(r["transfer_id"] for r in rows if r["kind"] == "ack")
        assert decided == Counter(ids), (source, decided)
    report = CliRunner().invoke(app, ["audit", *map(str, sorted(logs.glob("*.jsonl")))])
    assert report.exit_code == 0 and "no findings" in report.output, report.output
