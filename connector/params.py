"""`kv_transfer_params`: what the proxy and the engines put in a request, parsed and checked.

A request takes part in a transfer when its params carry a `transfer_id` (chosen
by the proxy, shared by both sides) and `do_remote_decode` (producer) or
`do_remote_prefill` (consumer). Host and ports in params are only *names* of a
peer: the connector dials them only if the configuration lists that peer.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from hashlib import blake2b
from typing import Any

import msgspec

from kvledger.connector.metadata import PeerRef
from kvledger.ledger.events import TransferId
from kvledger.ledger.valid import ints_problem, text_problem


class ParamsError(ValueError):
    """kv_transfer_params that name a transfer but cannot be used; the message names the field."""


class TransferParams(msgspec.Struct, frozen=True, kw_only=True):
    transfer_id: TransferId
    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_block_ids: tuple[int, ...] | None = None
    remote_block_groups: tuple[int, ...] | None = None
    """Hybrid models: how many of `remote_block_ids` belong to each KV cache group (None: one group)."""
    remote_engine_id: str = ""
    remote_host: str | None = None
    remote_handshake_port: int | None = None
    remote_notify_port: int | None = None
    remote_tp_size: int = 1
    remote_dp_rank: int = 0
    remote_generations: tuple[int, ...] | None = None
    """The producer's generation per TP rank (`connector/generation.py`): the lives whose layout this transfer's
    KV is in. A consumer whose link to a rank names another life handshakes again before it reads."""

    def taken(self) -> TransferParams:
        """These params once the request's one remote load was claimed (see `remote_prefill_taken`)."""
        return msgspec.structs.replace(self, do_remote_prefill=False)

    def peer(self) -> PeerRef | None:
        """The remote engine these params name, or None if they name none (`consumer_params` writes them)."""
        if self.remote_host is None or self.remote_handshake_port is None or self.remote_notify_port is None:
            return None
        return PeerRef(
            engine_id=self.remote_engine_id,
            host=self.remote_host,
            handshake_port=self.remote_handshake_port,
            notify_port=self.remote_notify_port,
            tp_size=self.remote_tp_size,
            dp_rank=self.remote_dp_rank,
            generations=self.remote_generations or (),
        )


def parse_params(raw: Mapping[str, Any] | None) -> TransferParams | None:
    """None when the request takes no part in a kvledger transfer; ParamsError when it is malformed."""
    if not raw or "transfer_id" not in raw:
        return None
    data = raw if type(raw) is dict else dict(raw)
    try:
        # Lax conversion (a port given as "7001") only widens what strict accepts, with the same result
        # where both accept: strict first is the same answer, and half the cost for well-typed params.
        params = msgspec.convert(data, TransferParams)
    except msgspec.ValidationError:
        try:
            params = msgspec.convert(data, TransferParams, strict=False)
        except msgspec.ValidationError as error:
            raise ParamsError(f"kv_transfer_params: {error}") from None
    if not params.transfer_id:
        raise ParamsError("kv_transfer_params.transfer_id: empty")
    # What the ledger will record must be a valid event (ledger/valid.py): refused here, at the edge, a
    # request runs without a transfer; recorded, it would be quarantined by the store instead.
    found = text_problem("transfer_id", params.transfer_id) or ints_problem("remote_block_ids", params.remote_block_ids)
    if found is not None:
        raise ParamsError(f"kv_transfer_params.{found[0]}: {found[1]}")
    groups = params.remote_block_groups
    if groups is not None and (min(groups, default=0) < 0 or sum(groups) != len(params.remote_block_ids or ())):
        raise ParamsError(f"kv_transfer_params.remote_block_groups: must add up to remote_block_ids, got {groups}")
    if params.remote_tp_size < 1:
        raise ParamsError(f"kv_transfer_params.remote_tp_size: must be >= 1, got {params.remote_tp_size}")
    lives = params.remote_generations
    if lives is not None and (len(lives) != params.remote_tp_size or min(lives, default=0) < 0):
        raise ParamsError(
            f"kv_transfer_params.remote_generations: one non-negative number per remote TP rank "
            f"({params.remote_tp_size}), got {list(lives)}"
        )
    return params


def prompt_digest(token_ids: Sequence[int]) -> str:
    """What binds a WRITE producer's request to its consumer's beyond the transfer id: both engines got
    the same prompt from the proxy. A consumer naming a transfer id the producer holds for another
    request (a client reusing ids) is told so instead of being written that request's KV."""
    try:
        data = array("q", token_ids).tobytes()
    except OverflowError:
        data = repr(tuple(token_ids)).encode()
    return blake2b(data, digest_size=16).hexdigest()


def remote_prefill_taken(raw: dict[str, Any]) -> None:
    """Say in a request's own `kv_transfer_params` that its remote KV was claimed, as vLLM's NIXL and
    MoRIIO connectors do after the first allocation ("only trigger 1 KV transfer per request"): when
    vLLM asks again (preemption, recompute after a failed load), the request computes locally."""
    raw["do_remote_prefill"] = False


class ConsumerParams:
    """What a producer's `request_finished` returns for the consumer (through the proxy): the transfer, the
    producer's blocks and the producer itself (its `ConnectorConfig.address`, as the `remote_*` fields that
    `TransferParams.peer` reads back). Built from a template of `producer`'s fields, taken once: a copy of it
    and two keys set cost half of a ten-key literal, on every request_finished."""

    def __init__(self, producer: PeerRef) -> None:
        # The producer's ranks' generations, once its scheduler learnt them (`SchedulerCore.set_generations`).
        # A tuple: every copy of the template shares it, so it must not be mutable.
        lives = {"remote_generations": producer.generations} if producer.generations else {}
        self._template: dict[str, Any] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "transfer_id": "",  # set per transfer, in place: the keys keep this order
            "remote_block_ids": [],  # set per transfer
            "remote_engine_id": producer.engine_id,
            "remote_host": producer.host,
            "remote_handshake_port": producer.handshake_port,
            "remote_notify_port": producer.notify_port,
            "remote_tp_size": producer.tp_size,
            "remote_dp_rank": producer.dp_rank,
            **lives,
        }

    def __call__(
        self, transfer_id: TransferId, block_ids: tuple[int, ...], *, block_groups: tuple[int, ...] | None = None
    ) -> dict[str, Any]:
        params = self._template.copy()
        params["transfer_id"] = transfer_id
        params["remote_block_ids"] = list(block_ids)
        return params if block_groups is None else {"remote_block_groups": list(block_groups), **params}


def consumer_params(
    transfer_id: TransferId,
    block_ids: tuple[int, ...],
    producer: PeerRef,
    *,
    block_groups: tuple[int, ...] | None = None,
) -> dict[str, Any]:
    """`ConsumerParams(producer)` for one transfer."""
    return ConsumerParams(producer)(transfer_id, block_ids, block_groups=block_groups)
