"""`kv_connector_extra_config.observe`: the connector to wrap, validated at start.

    {"kv_connector": "LedgerConnector", "kv_connector_module_path": "kvledger.connector", "kv_role": "kv_producer",
     "kv_connector_extra_config": {"incident_log_dir": "/var/log/kvledger",
       "observe": {"kv_connector": "NixlConnector", "kv_connector_extra_config": {...}}}}

`observe` holds the wrapped connector's own `KVTransferConfig` fields (as one
entry of MultiConnector's `connectors` list): `kv_connector`, optional
`kv_connector_module_path` and `kv_connector_extra_config`; the engine's other
transfer fields (`engine_id`, `kv_role`, ...) are inherited unless given. One key
is observe mode's own: `transfer_id_key`, which `kv_transfer_params` key names a
transfer for a connector without a named mapping (`keys.py`). The other keys
of the outer extra config are kvledger's (`ledger_url`, `incident_log_dir`,
`source_name`, `transfer_timeout`, ...), read by `connector/config.py`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvledger.connector.config import ConfigError
from kvledger.connector.observe.keys import ParamsKeys, keys_for

OBSERVE_KEY = "observe"
OWN_KEYS = frozenset({"transfer_id_key"})


@dataclass(frozen=True)
class ObserveConfig:
    wrapped: dict[str, Any]
    """The wrapped connector's KVTransferConfig fields (what is not inherited from the engine's)."""
    keys: ParamsKeys

    @property
    def wrapped_extra(self) -> dict[str, Any]:
        return dict(self.wrapped.get("kv_connector_extra_config") or {})

    @property
    def hold_s(self) -> float:
        return self.keys.hold_s(self.wrapped_extra)


def observe_config(extra: Mapping[str, Any] | None) -> ObserveConfig | None:
    """None when the extra config asks for no observe mode; ConfigError naming the key when it is malformed."""
    raw = (extra or {}).get(OBSERVE_KEY)
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ConfigError(f"kv_connector_extra_config.observe: expected an object, got {type(raw).__name__}")
    name = raw.get("kv_connector")
    if not isinstance(name, str) or not name:
        raise ConfigError("kv_connector_extra_config.observe.kv_connector: the connector to wrap, by name")
    if name == "LedgerConnector":
        raise ConfigError("kv_connector_extra_config.observe.kv_connector: LedgerConnector cannot observe itself")
    key = raw.get("transfer_id_key")
    if key is not None and (not isinstance(key, str) or not key):
        raise ConfigError("kv_connector_extra_config.observe.transfer_id_key: expected a non-empty string")
    inner_extra = raw.get("kv_connector_extra_config", {})
    if not isinstance(inner_extra, Mapping):
        raise ConfigError("kv_connector_extra_config.observe.kv_connector_extra_config: expected an object")
    wrapped = {k: v for k, v in raw.items() if k not in OWN_KEYS}
    return ObserveConfig(wrapped=wrapped, keys=keys_for(name, key))


def ledger_extra(extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """The outer extra config without `observe`: kvledger's own keys, for `connector/config.py`."""
    return {k: v for k, v in (extra or {}).items() if k != OBSERVE_KEY}
