"""Test hooks plugged in by name: `kv_connector_extra_config.test_hook_received_kv` names a callable as
`package.module:function`, imported here only when configured. The hooks themselves live with the tests
(`tests/e2e/hooks.py`); nothing under `connector/` imports them, and production configs name none."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeAlias

from kvledger.connector.config import ConfigError

ReceivedKvHook: TypeAlias = Callable[[Mapping[str, Any], Mapping[str, int], Iterable[int]], int]
"""Called with a consumer worker's KV caches (layer name -> tensor), each layer's block axis and the blocks
that completed receives loaded; returns the blocks it touched."""


def load_hook(path: str, key: str) -> ReceivedKvHook:
    """The callable `path` names (`module:function`); ConfigError naming `key` if it cannot be imported."""
    module_name, _, name = path.partition(":")
    try:
        hook = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as error:
        raise ConfigError(f"kv_connector_extra_config[{key!r}]: cannot import {path!r}: {error}") from None
    if not callable(hook):
        raise ConfigError(f"kv_connector_extra_config[{key!r}]: {path!r} is not callable")
    return hook  # type: ignore[no-any-return]
