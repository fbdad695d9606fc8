"""Typed notification messages between engines, msgpack on the wire, with a version field.

Every message is a frozen msgspec Struct tagged by `type` (MoRIIO's names:
`remote_blocks`, `write_done`, `write_failed`, `release`, plus `lease` renewals
and the handshake pair). `decode` never raises on bad input: it returns a `Rejected` value saying
why, so the listener can count and drop it. A transfer id, rank or block id that
the ledger will record must be valid there too (`kvledger.ledger.valid`): a peer cannot
make this process append an event its store would refuse.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Annotated, TypeAlias

import msgspec

from kvledger.connector.layout import LayerDescriptor
from kvledger.connector.limits import LEASE_IDS_PER_MESSAGE_MAX, MESSAGE_BYTES_MAX, MESSAGE_VERSION
from kvledger.connector.mamba import MambaGroup
from kvledger.connector.metadata import PeerRef
from kvledger.connector.ports import rank_port
from kvledger.connector.transports.base import TransportEndpoint
from kvledger.ledger.events import FailCode
from kvledger.ledger.valid import Int64, TransferIdText


class RankAddress(msgspec.Struct, frozen=True, kw_only=True):
    """Who sent a message: an engine's base ports and the sender's rank (peers compute its ports)."""

    engine_id: str
    host: str
    handshake_port: int
    notify_port: int
    dp_rank: int = 0
    tp_rank: int = 0
    tp_size: int = 1

    @classmethod
    def of(cls, engine: PeerRef, tp_rank: int) -> RankAddress:
        """Rank `tp_rank` of `engine`."""
        return cls(
            engine_id=engine.engine_id,
            host=engine.host,
            handshake_port=engine.handshake_port,
            notify_port=engine.notify_port,
            dp_rank=engine.dp_rank,
            tp_rank=tp_rank,
            tp_size=engine.tp_size,
        )

    def port(self, base: int) -> int:
        """The port this rank listens on for the engine base port `base` (its handshake or notify port)."""
        return rank_port(base, self.dp_rank, self.tp_rank, self.tp_size)


class _Message(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", forbid_unknown_fields=True):
    version: int = MESSAGE_VERSION
    mac: bytes = b""
    """HMAC-SHA256 over the message's encoding with an empty `mac`, under the shared control key (empty
    without one)."""
    receiver: str = ""
    """The `host:port` the sender addressed (`Channel.send` fills it in before signing): covered by the MAC,
    so a message recorded on its way to one rank is refused by every other (`Channel` checks it)."""
    generation: int = 0
    """The sending rank's generation (`connector/generation.py`; its channel fills it in before signing, so the
    MAC covers it): which life of the sender said this. A WRITE producer writes only over a link to that life
    of the consumer; a handshake's is the life its layout belongs to. 0: none named."""


class RemoteBlocks(_Message, frozen=True, tag="remote_blocks"):
    """WRITE mode, consumer -> producer: my blocks for this transfer are allocated; write here."""

    transfer_id: TransferIdText
    block_ids: tuple[Int64, ...]
    sender: RankAddress
    prompt_digest: str | None = None
    """The consumer request's prompt digest (`params.prompt_digest`): a producer holding the id for a
    request with another prompt answers write_failed instead of writing that request's KV here."""
    block_groups: tuple[Int64, ...] | None = None
    """Hybrid models: `block_ids` per KV cache group, as counts (`kvledger.ledger.events.Map.block_groups`); the
    producer writes each layer into the blocks of its own group. None: one group."""

    def __post_init__(self) -> None:
        # Raised inside decode, so such bytes are `Rejected` as malformed, naming the counts.
        groups = self.block_groups
        if groups is not None and (any(count < 0 for count in groups) or sum(groups) != len(self.block_ids)):
            raise ValueError(f"block_groups {list(groups)} do not split {len(self.block_ids)} block ids")


class WriteDone(_Message, frozen=True, tag="write_done"):
    """WRITE mode, producer rank -> consumer: every layer of this transfer landed."""

    transfer_id: TransferIdText
    rank: Int64


class WriteFailed(_Message, frozen=True, tag="write_failed"):
    """WRITE mode, producer rank -> consumer: the write will not complete; do not decode."""

    transfer_id: TransferIdText
    rank: Int64
    reason: str
    code: FailCode = "error"
    """What the consumer's `fail` says to its fold (`read_refused`: the producer no longer held the side)."""


class ReleaseBlocks(_Message, frozen=True, tag="release"):
    """Consumer rank -> holder rank: you may free this transfer's blocks (read done, or aborted)."""

    transfer_id: TransferIdText
    rank: Int64
    consumer_tp_size: int


class LeaseRenew(_Message, frozen=True, tag="lease"):
    """Consumer rank -> holder rank: these transfers' requests still wait here; hold their blocks one more
    lease (`kv_lease_duration` from receipt). Sent at a bounded rate (a sixth of the lease), never waited on."""

    transfer_ids: Annotated[tuple[TransferIdText, ...], msgspec.Meta(max_length=LEASE_IDS_PER_MESSAGE_MAX)]
    """At most LEASE_IDS_PER_MESSAGE_MAX: a longer list is `Rejected` as malformed before its ids are decoded."""
    rank: Int64
    sender: RankAddress | None = None
    """The renewing consumer rank: a producer counts a renewal only from the consumer the transfer is bound
    to (`PeerMessages._on_lease`); a renewal without it is refused."""


class ReadIntent(_Message, frozen=True, tag="read_intent"):
    """Consumer rank -> holder rank, for a one-sided read (mori) that the producer's CPU never sees: before
    the read (`after` False), "do you hold this transfer? hold it while I read"; after it (`after` True), "did
    you hold it throughout?". The answer is a `read_confirm`; a read not confirmed both times is a load error."""

    transfer_id: TransferIdText
    sender: RankAddress
    after: bool = False


class ReadConfirm(_Message, frozen=True, tag="read_confirm"):
    """Holder rank -> consumer rank: whether it holds the transfer now (a hold never comes back once let go,
    so held after the read means held throughout it)."""

    transfer_id: TransferIdText
    rank: Int64
    held: bool | None
    """None: not mapped on this rank yet (its metadata comes with its next step): ask again."""
    after: bool = False


class HandshakeRequest(_Message, frozen=True, tag="handshake_request"):
    sender: RankAddress


class HandshakeMetadata(_Message, frozen=True, tag="handshake"):
    """What a dialer needs to move KV with this rank: its transport endpoint and layer geometry."""

    engine_id: str
    dp_rank: int
    tp_rank: int
    tp_size: int
    endpoint: TransportEndpoint
    layers: tuple[LayerDescriptor, ...]
    mamba: tuple[MambaGroup, ...] = ()
    """Hybrid Mamba models: the Mamba groups whose state regions are among `layers` (both sides must agree)."""


Message: TypeAlias = (
    RemoteBlocks
    | WriteDone
    | WriteFailed
    | ReleaseBlocks
    | LeaseRenew
    | ReadIntent
    | ReadConfirm
    | HandshakeRequest
    | HandshakeMetadata
)


class Rejected(msgspec.Struct, frozen=True):
    """Why bytes off the wire were not a message: `oversized`, `malformed` or `version`."""

    reason: str
    detail: str


_encoder = msgspec.msgpack.Encoder()
_decoder: msgspec.msgpack.Decoder[Message] = msgspec.msgpack.Decoder(Message)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def _mac(message: Message, key: bytes) -> bytes:
    unsigned = msgspec.structs.replace(message, mac=b"")
    return hmac.new(key, _encoder.encode(unsigned), hashlib.sha256).digest()


def sign(message: Message, key: bytes | None) -> Message:
    """`message` with its MAC under `key` (unchanged without a key)."""
    if key is None:
        return message
    return msgspec.structs.replace(message, mac=_mac(message, key))


def authentic(message: Message, key: bytes | None, next_key: bytes | None = None) -> bool:
    """Whether `message` carries a valid MAC under `key` or, during a rotation, `next_key` (every message
    is, without a key)."""
    if key is None:
        return True
    if not message.mac:
        return False
    return any(hmac.compare_digest(message.mac, _mac(message, k)) for k in (key, next_key) if k is not None)


def transfer_of(message: Message) -> str | None:
    if isinstance(message, LeaseRenew):
        return message.transfer_ids[0] if message.transfer_ids else None
    tid: str | None = getattr(message, "transfer_id", None)
    return tid


def decode(data: bytes | memoryview, *, max_bytes: int = MESSAGE_BYTES_MAX) -> Message | Rejected:
    """The message in `data`, or a `Rejected` naming why not; never raises on bad input."""
    if len(data) > max_bytes:
        return Rejected("oversized", f"{len(data)} bytes > {max_bytes}")
    try:
        message = _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as error:
        return Rejected("malformed", str(error)[:200])
    if message.version != MESSAGE_VERSION:
        return Rejected("version", f"version {message.version}, this build speaks {MESSAGE_VERSION}")
    return message
