"""Which of a wrapped connector's own `kv_transfer_params` name a transfer: one small, named mapping per connector.

vLLM's P/D connectors do not share a transfer id. NIXL names a transfer by the
producer's request id (the consumer's params carry it as `remote_request_id`);
MoRIIO and Mooncake carry a router-chosen `transfer_id` on both sides. Every one
marks a producer request with `do_remote_decode` and a consumer request with
`do_remote_prefill`. A connector not listed here is observed through the
configured `transfer_id_key` (`observe.transfer_id_key`), read on both sides.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from kvledger.ledger.events import Mode, ReqId, TransferId


@dataclass(frozen=True)
class ParamsKeys:
    """How to read one connector's `kv_transfer_params`.

    `producer_id_key` None: the producer's transfer id is its own request id (NIXL's `remote_request_id`
    is that id, handed to the consumer). `hold_key`: the wrapped connector's extra-config key for how long
    a producer holds blocks waiting for its consumer (its lease), `hold_default_s` when unset.
    `expired_stat`: the name under which the wrapped connector's stats count requests it freed by timeout."""

    connector: str
    mode: Mode
    consumer_id_key: str
    producer_id_key: str | None = None
    producer_flag: str = "do_remote_decode"
    consumer_flag: str = "do_remote_prefill"
    remote_blocks_key: str = "remote_block_ids"
    peer_key: str = "remote_engine_id"
    hold_key: str | None = None
    hold_default_s: float = 480.0
    expired_stat: str | None = None
    sync_save: bool = False
    """The producer's KV has left before `request_finished` (saved during the forward), which then frees
    at once: the side is recorded as mapped and released there."""

    def producer(self, params: Mapping[str, Any] | None) -> bool:
        return bool(params) and bool(params.get(self.producer_flag))  # type: ignore[union-attr]

    def consumer(self, params: Mapping[str, Any] | None) -> bool:
        return bool(params) and bool(params.get(self.consumer_flag))  # type: ignore[union-attr]

    def producer_transfer_id(self, request_id: ReqId, params: Mapping[str, Any] | None) -> TransferId | None:
        if self.producer_id_key is None:
            return TransferId(request_id)
        return _text(params, self.producer_id_key)

    def consumer_transfer_id(self, params: Mapping[str, Any] | None) -> TransferId | None:
        return _text(params, self.consumer_id_key)

    def remote_blocks(self, params: Mapping[str, Any] | None) -> tuple[int, ...] | None:
        """The producer's blocks a consumer loads from (one KV cache group, or every group's concatenated)."""
        raw = (params or {}).get(self.remote_blocks_key)
        if not isinstance(raw, list | tuple):
            return None
        flat: list[int] = []
        for item in raw:
            flat.extend(item if isinstance(item, list | tuple) else (item,))
        return tuple(int(b) for b in flat)

    def peer(self, params: Mapping[str, Any] | None) -> str | None:
        value = (params or {}).get(self.peer_key)
        return str(value) if value else None

    def hold_s(self, extra_config: Mapping[str, Any]) -> float:
        if self.hold_key is None:
            return self.hold_default_s
        return float(extra_config.get(self.hold_key, self.hold_default_s))


def _text(params: Mapping[str, Any] | None, key: str) -> TransferId | None:
    value = (params or {}).get(key)
    return TransferId(str(value)) if value not in (None, "") else None


NIXL = ParamsKeys(
    connector="NixlConnector",
    mode="read",
    consumer_id_key="remote_request_id",
    hold_key="kv_lease_duration",
    hold_default_s=30.0,
    expired_stat="num_kv_expired_reqs",
)
NIXL_PUSH = replace(NIXL, connector="NixlPushConnector", mode="write")
"""NIXL's push (WRITE) variant: the same keys."""
MORIIO = ParamsKeys(
    connector="MoRIIOConnector", mode="read", consumer_id_key="transfer_id", producer_id_key="transfer_id"
)
MOONCAKE = ParamsKeys(
    connector="MooncakeConnector", mode="read", consumer_id_key="transfer_id", producer_id_key="transfer_id"
)
EXAMPLE = ParamsKeys(
    connector="ExampleConnector",
    mode="write",
    consumer_id_key="transfer_id",
    producer_id_key="transfer_id",
    sync_save=True,
)
"""vLLM's in-tree reference connector (a shared folder): it reads no params; a `transfer_id` names a transfer."""

NAMED: dict[str, ParamsKeys] = {k.connector: k for k in (NIXL, NIXL_PUSH, MORIIO, MOONCAKE, EXAMPLE)} | {
    "NixlPullConnector": NIXL
}


def keys_for(connector: str, transfer_id_key: str | None = None) -> ParamsKeys:
    """The named mapping for `connector`; any other connector (or an explicit `transfer_id_key`) reads
    that one key on both sides."""
    if transfer_id_key is None and connector in NAMED:
        return NAMED[connector]
    key = transfer_id_key or "transfer_id"
    return ParamsKeys(connector=connector, mode="read", consumer_id_key=key, producer_id_key=key)
