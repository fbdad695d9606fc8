"""`LedgerPromMetrics` on prometheus_client's own metric classes, in a private registry (vLLM imported at call
time, as the adapter's tests do)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any


def registry_metrics(engines: int) -> tuple[Any, Any]:
    """(registry, metrics) with one engine label value per engine index: `("m", "<index>")`."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from kvledger.connector.prom import LedgerPromMetrics

    registry = CollectorRegistry()

    def bound(cls: type[Any]) -> type[Any]:
        class Private(cls):  # type: ignore[misc]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                kwargs.pop("multiprocess_mode", None)
                super().__init__(*args, registry=registry, **kwargs)

        return Private

    types = {Gauge: bound(Gauge), Counter: bound(Counter), Histogram: bound(Histogram)}
    config = SimpleNamespace(kv_transfer_config=None)  # all the base class reads of vLLM's config
    labels: dict[int, list[object]] = {i: ["m", str(i)] for i in range(engines)}
    return registry, LedgerPromMetrics(config, types, ["model_name", "engine"], labels)  # type: ignore[arg-type]


def sample(registry: Any, name: str, engine: int = 0, **labels: str) -> float:
    """A sample's value (0 when the series has none)."""
    value = registry.get_sample_value(name, {"model_name": "m", "engine": str(engine), **labels})
    return float(value or 0)
