"""Observe mode's `build_prom_metrics` under vLLM's real metric path: the ledger's `vllm:kvledger_*` beside the
wrapped NIXL connector's own `vllm:nixl_*`, each fed its part of one stats payload (a private registry)."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats

from kvledger.connector.observe.names import KVLEDGER, WRAPPED, WRAPPED_CONNECTOR
from kvledger.connector.vllm_connector import LedgerConnector
from tests.e2e.sched_harness import make_vllm_config

pytestmark = pytest.mark.vllm


def _types(registry: CollectorRegistry) -> dict[type[Any], type[Any]]:
    def bound(cls: type[Any]) -> type[Any]:
        class Private(cls):  # type: ignore[misc, valid-type]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                kwargs.pop("multiprocess_mode", None)
                super().__init__(*args, registry=registry, **kwargs)

        return Private

    return {Gauge: bound(Gauge), Counter: bound(Counter), Histogram: bound(Histogram)}


def test_the_wrapped_connectors_metrics_are_published_beside_the_ledgers(model: str) -> None:
    extra = {"observe": {"kv_connector": "NixlConnector", "kv_connector_extra_config": {}}}
    config = make_vllm_config(model, "kv_producer", extra)
    registry = CollectorRegistry()
    prom = LedgerConnector.build_prom_metrics(config, _types(registry), ["model_name", "engine"], {0: ["m", "0"]})
    assert prom is not None
    nixl = NixlKVConnectorStats()
    nixl.data["num_kv_expired_reqs"].append(1)
    figures = {"requests_held": 2, "blocks_held": 6, "live_by_phase": {"held": 2},
               "released": {"completed": 3, "failed": 0, "expired": 1}, "findings": {"leak": 1},
               "ack_latency_s": [0.5], "release_latency_s": [0.5, 31.0]}  # fmt: skip
    prom.observe({WRAPPED: nixl.to_dict(), KVLEDGER: figures, WRAPPED_CONNECTOR: "NixlConnector"}, 0)
    prom.observe({WRAPPED: None, KVLEDGER: figures, WRAPPED_CONNECTOR: "NixlConnector"}, 0)  # same totals again

    def get(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"model_name": "m", "engine": "0", **labels})

    assert get("vllm:nixl_num_kv_expired_reqs_total") == 1  # NIXL's own metric, fed NIXL's own stats
    assert get("vllm:kvledger_requests_held") == 2
    assert get("vllm:kvledger_blocks_held") == 6
    assert get("vllm:kvledger_live_transfers", phase="held") == 2
    assert get("vllm:kvledger_releases_total", cause="expired") == 1  # cumulative figures are counted once
    assert get("vllm:kvledger_releases_total", cause="completed") == 3
    assert get("vllm:kvledger_findings", code="leak") == 1
    assert get("vllm:kvledger_release_latency_seconds_count") == 4
