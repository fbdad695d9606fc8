"""Observe mode passes every call of vLLM's connector interface to the wrapped connector: none is left to
the base class's defaults (a vLLM release that adds a hook fails here until the hook is delegated)."""

from __future__ import annotations

import inspect

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

from kvledger.connector.observe.adapter import ObserveConnector

pytestmark = pytest.mark.vllm

CLASS_LEVEL = {"build_kv_connector_stats", "build_prom_metrics", "get_required_kvcache_layout",
               "requires_piecewise_for_cudagraph", "supports_sleep_mode"}  # fmt: skip
"""Asked of the configured class (LedgerConnector), which answers for the wrapped class in observe mode."""


def test_every_hook_of_the_base_class_is_delegated() -> None:
    missing = []
    for name, member in inspect.getmembers(KVConnectorBase_V1):
        if name.startswith("__") or name in CLASS_LEVEL or name == "role":
            continue
        if not (callable(member) or isinstance(member, property)):
            continue
        if ObserveConnector.__dict__.get(name) is None:
            missing.append(name)
    assert not missing, f"not delegated by ObserveConnector: {missing}"
