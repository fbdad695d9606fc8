"""The transfer event kinds (six about a transfer, plus `drop`) and their envelope; immutable msgspec Structs.

Every event carries `seq` (assigned by the log at append), `ts` (seconds, the
appender's wall clock), `source` (engine and rank), `kind` (the tag) and
`transfer_id`. `seq == 0` means "not yet assigned": the log gives it one.
"""

from __future__ import annotations

from typing import Literal, NewType, TypeAlias

import msgspec

TransferId = NewType("TransferId", str)
"""One KV transfer between a producer and a consumer, chosen by the proxy."""

ReqId = NewType("ReqId", str)
"""A local vLLM request id; different on the producer and the consumer."""

Role: TypeAlias = Literal["producer", "consumer"]
Mode: TypeAlias = Literal["read", "write"]
AckWhat: TypeAlias = Literal["write", "read", "release", "recv", "lease"]
DeadlineName: TypeAlias = Literal["defer", "transfer"]
FailCode: TypeAlias = Literal["error", "read_refused", "aborted_before_allocation"]
"""What a failure means for the ledger, a closed set (the free-text `reason` is for people): `error`, any
failure; `read_refused`, a read the producer refused (its side was no longer held) or one a consumer
could not confirm, counted apart; `aborted_before_allocation`, a consumer request vLLM dropped before
it held blocks, which vLLM must not be told about again."""

UNASSIGNED_SEQ = 0


class _Envelope(
    msgspec.Struct,
    frozen=True,
    kw_only=True,
    tag_field="kind",
    omit_defaults=True,
    forbid_unknown_fields=True,
    gc=False,
):
    seq: int = UNASSIGNED_SEQ
    ts: float
    source: str
    transfer_id: TransferId


class Map(_Envelope, tag="map", frozen=True):
    """Local request `request_id` takes part in the transfer and holds `block_ids`."""

    request_id: ReqId
    role: Role
    mode: Mode
    block_ids: tuple[int, ...]
    deadline: float
    remote_block_ids: tuple[int, ...] | None = None
    peer: str | None = None
    acks_expected: int = 1
    block_groups: tuple[int, ...] | None = None
    """vLLM's hybrid models (more than one KV cache group): how many of `block_ids` belong to each
    group, in group order (`block_ids` is their concatenation). None: one group."""
    remote_block_groups: tuple[int, ...] | None = None
    """The same for `remote_block_ids`."""

    def __post_init__(self) -> None:
        if self.acks_expected < 1:
            raise ValueError(f"map.acks_expected must be >= 1, got {self.acks_expected}")
        # Runs for every map decoded (a tenth of an ingest batch's decoding when it built a table of both
        # groupings each time): the usual map, one group each way, checks no more.
        if self.block_groups is not None:
            _check_groups("block_groups", self.block_groups, self.block_ids)
        if self.remote_block_groups is not None:
            _check_groups("remote_block_groups", self.remote_block_groups, self.remote_block_ids)


def _check_groups(name: str, groups: tuple[int, ...], blocks: tuple[int, ...] | None) -> None:
    if min(groups, default=0) < 0 or sum(groups) != len(blocks or ()):
        raise ValueError(f"map.{name} must be counts that add up to the blocks listed, got {groups}")


def block_groups_of(block_ids: tuple[int, ...], groups: tuple[int, ...] | None) -> tuple[tuple[int, ...], ...]:
    """`block_ids` split into its KV cache groups (`Map.block_groups`): one group when `groups` is None."""
    if groups is None:
        return (block_ids,)
    out: list[tuple[int, ...]] = []
    start = 0
    for count in groups:
        out.append(block_ids[start : start + count])
        start += count
    return tuple(out)


class Schedule(_Envelope, tag="schedule", frozen=True):
    """A transfer operation is issued (or deferred: the remote is not ready yet).

    `layers` names the layers written in this step (WRITE mode); `None` is the
    whole transfer (`*`, READ mode).
    """

    op: Mode
    layers: tuple[int, ...] | None = None
    attempt: int = 0
    deferred: bool = False


class Seal(_Envelope, tag="seal", frozen=True):
    """After the forward pass: the number of layer operations to expect is fixed."""

    expected: int

    def __post_init__(self) -> None:
        if self.expected < 0:
            raise ValueError(f"seal.expected must be >= 0, got {self.expected}")


class Ack(_Envelope, tag="ack", frozen=True):
    """A completion was observed.

    `write`: layers landed; `read`: a read finished (`layers` None = all);
    `release`: consumer rank `rank` says the producer may free; `recv`: all KV
    arrived at the consumer; `lease`: the consumer (rank `rank`) still waits for
    this transfer and renewed the producer's hold until `until` (absolute ts).

    A lease renewal is an `ack`, not a seventh kind nor a `schedule`: like
    `release` it is what a producer observes from its consumer over the control
    channel (authenticated the same way), it is folded on the side it names and,
    after the side's decision, it is late evidence like any ack (a renewal after
    an expire means the lease was too short for the consumer's rhythm). A
    `schedule` is what a side itself issues; a renewal issues nothing. Its only
    effect is to move the side's deadline later (never earlier).
    """

    what: AckWhat
    layers: tuple[int, ...] | None = None
    rank: int = 0
    until: float | None = None
    """`lease` only: the new deadline the renewal asks for."""

    def __post_init__(self) -> None:
        if (self.what == "lease") != (self.until is not None):
            raise ValueError("ack.until is set exactly for a lease ack")


class Fail(_Envelope, tag="fail", frozen=True):
    """An operation failed; `retryable` failures (send queue full) are not terminal."""

    reason: str
    retryable: bool = False
    code: FailCode = "error"


class Expire(_Envelope, tag="expire", frozen=True):
    """The appender's clock saw the named deadline pass."""

    deadline: DeadlineName


class Drop(_Envelope, tag="drop", frozen=True):
    """A control message from a peer was refused as unproven (a missing or wrong MAC, or a sender outside
    the allow-list). It changes no decision: it is recorded so that the audit shows it (`forged_message`).
    `transfer_id` is the one the message named (`-` when it named none)."""

    message: str
    sender: str
    reason: str


Event: TypeAlias = Map | Schedule | Seal | Ack | Fail | Expire | Drop
EVENT_TYPES: tuple[type[_Envelope], ...] = (Map, Schedule, Seal, Ack, Fail, Expire, Drop)
KINDS: tuple[str, ...] = ("map", "schedule", "seal", "ack", "fail", "expire", "drop")


KIND_OF_TYPE: dict[type[_Envelope], str] = dict(zip(EVENT_TYPES, KINDS, strict=True))
"""Each event type's tag: a dict lookup where a hot loop counts kinds (the service's fold)."""


def kind_of(event: Event) -> str:
    """The event's tag (`map`, `ack`, ...)."""
    return KIND_OF_TYPE[type(event)]


_json_encoder = msgspec.json.Encoder()
_json_decoder: msgspec.json.Decoder[Event] = msgspec.json.Decoder(Event)
_msgpack_encoder = msgspec.msgpack.Encoder()
_msgpack_decoder: msgspec.msgpack.Decoder[Event] = msgspec.msgpack.Decoder(Event)


def to_json(event: Event) -> bytes:
    return _json_encoder.encode(event)


def from_json(data: bytes | str) -> Event:
    return _json_decoder.decode(data)


def to_msgpack(event: Event) -> bytes:
    return _msgpack_encoder.encode(event)


def from_msgpack(data: bytes) -> Event:
    return _msgpack_decoder.decode(data)
