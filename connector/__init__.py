"""kvledger's KV connector: a vLLM-free core (scheduler.py, worker.py) and a thin vLLM adapter.

`LedgerConnector` is resolved lazily so that `import kvledger.connector` (the simulator,
the CLI's demo, the tests) never imports vllm or torch; vLLM's factory does
`getattr(importlib.import_module("kvledger.connector"), "LedgerConnector")`, which lands here.
"""

from __future__ import annotations

from typing import Any

from kvledger.connector import compiled as _compiled

_compiled.install()  # before anything imports a hook module: which build of them loads (connector/compiled.py)

__all__ = ["LedgerConnector"]


def __getattr__(name: str) -> Any:
    if name == "LedgerConnector":
        from kvledger.connector.vllm_connector import LedgerConnector

        return LedgerConnector
    raise AttributeError(f"module 'kvledger.connector' has no attribute {name!r}")
