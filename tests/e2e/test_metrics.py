"""`vllm:kvledger_*` in a real engine's Prometheus metrics, in both modes, scraped over HTTP on loopback.

Not vLLM's OpenAI server (an API server plus an engine process per test is too
heavy for this machine): the engine process serves the prometheus_client
registry that vLLM's Prometheus stat logger writes to, which is what that server
mounts at `/metrics`, with `prometheus_client.start_http_server` on 127.0.0.1.
"""

from __future__ import annotations

import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvledger.connector.ports import free_loopback_ports
from tests.e2e.harness import (
    allocate_ports,
    consumer_side,
    engine,
    engines,
    ledger_extra,
    ledger_transfer_config,
    prompts,
    transfer_id,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def scrape(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        text = response.read().decode()
    return {
        (s.name, frozenset((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine"))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("vllm:kvledger_")
    }


def value(metrics: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    return metrics[(name, frozenset(labels.items()))]


def test_observe_mode_publishes_the_ledger_in_vllm_metrics(tiny_model: str, tmp_path: Path) -> None:
    (port,) = free_loopback_ports(1)
    extra = {
        "incident_log_dir": str(tmp_path / "logs"),
        "observe": {
            "kv_connector": "ExampleConnector",
            "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "kv")},
        },
    }
    spec: dict[str, Any] = {
        "model": tiny_model,
        "metrics_port": port,
        "kv_transfer_config": ledger_transfer_config("kv_producer", "prefill-0", extra),
    }
    batch = prompts(3, base_len=190)
    with engine("prefill", spec) as producer:
        producer.generate(
            [
                {
                    "prompt": p,
                    "max_tokens": 1,
                    "kv_transfer_params": {"transfer_id": transfer_id(), "do_remote_decode": True},
                }
                for p in batch
            ]
        )
        metrics = scrape(port)
    assert value(metrics, "vllm:kvledger_releases_total", cause="completed") == 3
    assert value(metrics, "vllm:kvledger_releases_total", cause="expired") == 0
    assert value(metrics, "vllm:kvledger_requests_held") == 0
    assert value(metrics, "vllm:kvledger_blocks_held") == 0
    assert value(metrics, "vllm:kvledger_ack_latency_seconds_count") == 3
    assert value(metrics, "vllm:kvledger_release_latency_seconds_count") == 3
    assert value(metrics, "vllm:kvledger_findings", code="leak") == 0
    assert value(metrics, "vllm:kvledger_live_transfers", phase="held") == 0


def test_ledger_mode_publishes_held_blocks_then_releases(tiny_model: str, tmp_path: Path) -> None:
    producer_ports, consumer_ports = allocate_ports()
    metrics_port, consumer_metrics_port = free_loopback_ports(2)
    logs = tmp_path / "logs"
    producer_spec = {
        "model": tiny_model,
        "metrics_port": metrics_port,
        "kv_transfer_config": ledger_transfer_config(
            "kv_producer", "prefill-0", ledger_extra("read", producer_ports, consumer_ports, logs)
        ),
    }
    consumer_spec = {
        "model": tiny_model,
        "metrics_port": consumer_metrics_port,
        "kv_transfer_config": ledger_transfer_config(
            "kv_consumer", "decode-0", ledger_extra("read", consumer_ports, producer_ports, logs)
        ),
    }
    batch = prompts(2, base_len=190)
    with engines(("prefill", producer_spec), ("decode", consumer_spec)) as (producer, consumer):
        prefilled = producer.generate(
            [
                {
                    "prompt": p,
                    "max_tokens": 1,
                    "kv_transfer_params": {"transfer_id": transfer_id(), "do_remote_decode": True},
                }
                for p in batch
            ]
        )
        held = scrape(metrics_port)  # the producer holds every prompt's blocks until its consumer releases them
        assert value(held, "vllm:kvledger_requests_held") == 2
        assert value(held, "vllm:kvledger_blocks_held") >= 2
        assert value(held, "vllm:kvledger_live_transfers", phase="held") == 2
        consumer.generate(
            [
                {"prompt": p, "max_tokens": 4, "kv_transfer_params": consumer_side(o["kv_transfer_params"])}
                for p, o in zip(batch, prefilled, strict=True)
            ]
        )
        assert producer.call({"op": "drain", "timeout_s": 60})["idle"]
        producer.generate([{"prompt": [5] * 20, "max_tokens": 1}])  # one more step reports the released state
        after = scrape(metrics_port)
        decoded = scrape(consumer_metrics_port)
    assert value(after, "vllm:kvledger_releases_total", cause="completed") == 2
    assert value(after, "vllm:kvledger_requests_held") == 0
    assert value(after, "vllm:kvledger_release_latency_seconds_count") == 2
    assert value(decoded, "vllm:kvledger_releases_total", cause="completed") == 2
    assert value(decoded, "vllm:kvledger_ack_latency_seconds_count") == 2
    assert value(decoded, "vllm:kvledger_control_messages_dropped_total", reason="none") == 0
