"""Encode and decode a folded LedgerState as msgpack of plain data (no pickle), keeping every order.

Dict and heap orders are part of the state (the orphan audit walks `unmapped` in
first-sight order, the deadline heap is a list), so each is written as a list in
its order; sets are written sorted. A change to LedgerState's or TransferState's
fields makes `encode` fail loudly and `decode` refuse older snapshots (recovery
then refolds from the start) rather than silently dropping a field.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from itertools import chain
from typing import Protocol, TypeVar, cast

import msgspec

from kvledger.ledger.decisions import Cause, Key
from kvledger.ledger.events import Drop, TransferId
from kvledger.ledger.fold import LedgerState
from kvledger.ledger.idmemory import IdMemory
from kvledger.ledger.limits import FORGED_KEPT_MAX
from kvledger.ledger.side import TransferState, copies, wide_masks
from kvledger.ledger.tombstone import Compacted

FORMAT = 12
"""Bumped whenever the encoding below changes (9: the id memory's bits are set by `key_hash`, no longer
blake2b, so an older snapshot's filter would answer wrongly; 10: sides written as `TransferState` arrays;
11: `forged_recent` written, so that the audit's forged_message findings survive a restart; 12: findings
counted when found (`found_by_code`, and the kinds a tombstone's side had), `sides_unchecked`)."""

_STATE_FIELDS = frozenset({
    "transfers", "live", "unmapped", "deadlines", "held", "contested", "double_owned", "anomalous",
    "orphans_expired", "expired_producers", "retrying", "sources", "tombstones", "tombstones_old",
    "tombstones_max", "tombstones_evicted", "id_memory", "orphan_tombstones", "orphan_tombstones_old",
    "orphan_tombstones_max", "orphans_evicted", "sides_unchecked", "late_after_eviction", "reused_after_eviction",
    "releases_by_cause", "blocks_held", "decided", "layer_masks", "forged_recent", "sides_of",
})  # fmt: skip
"""Every LedgerState field this encoding knows; `layer_masks` and `sides_of` (`transfers` by source) are
rebuilt, not written. `forged_recent` (the drops the audit's forged_message findings name) is written whole:
a finding that lives in the fold's state must read the same after a snapshot round trip."""
_COUNTER_FIELDS = ("compacted_by_phase", "compacted_by_mode", "forged_by_reason", "lease_counts", "found_by_code")
"""Plain str -> int counters, written as (key, count) lists to keep their order."""


_MASK_NAMES = tuple(name for name in TransferState.__struct_fields__ if name.endswith("_mask"))
"""Layer and rank bitmasks: ints, past 64 bits on a model of more layers (126), which msgpack cannot hold."""
WIDE_MASK_BITS = 63
"""A mask wider than this is written apart (`_Sides.wide`): msgpack's ints stop at 64 bits (63 signed)."""


SIDES_PER_CHUNK = 4096
"""Sides encoded per call of the encoder (about 2 MB, a few ms): it holds the GIL for a call, and between
calls the service's event loop serves requests and folds ingested batches."""


class _Sides(msgspec.Struct, array_like=True):
    """Sides as written: each an array of its fields (`TransferState` is array-like, so they decode straight
    into sides), in chunks of SIDES_PER_CHUNK, and apart the masks such an array cannot carry (0 in it)."""

    chunks: list[list[TransferState]]
    wide: list[tuple[int, str, bytes]] = []
    """(index, mask field, little-endian bytes) of each mask wider than WIDE_MASK_BITS."""


def _stored(sides: Iterable[TransferState]) -> _Sides:
    """Copies of `sides` as they are now (`copies`): the fold may go on while they are encoded."""
    out = copies(sides)
    wide: list[tuple[int, str, bytes]] = []
    for i in wide_masks(out, WIDE_MASK_BITS):  # a model of more layers: rare
        t = out[i]
        for name in _MASK_NAMES:
            mask: int = getattr(t, name)
            if mask.bit_length() > WIDE_MASK_BITS:
                wide.append((i, name, mask.to_bytes((mask.bit_length() + 7) // 8, "little")))
                setattr(t, name, 0)
    return _Sides([out[i : i + SIDES_PER_CHUNK] for i in range(0, len(out), SIDES_PER_CHUNK)], wide)


def _chunks_encoded(stored: _Sides) -> _Sides:
    """`stored` with each chunk encoded by a call of its own (SIDES_PER_CHUNK), nested as it is."""
    chunks = [msgspec.Raw(_encoder.encode(chunk)) for chunk in stored.chunks]
    return _Sides(cast(list[list[TransferState]], chunks), stored.wide)  # Raw: written as the chunk it holds


def sides_taken(document: Document) -> Iterator[TransferState]:
    """The sides `take` copied, in `transfers` order."""
    return chain.from_iterable(document.transfers.chunks)


def _restored(stored: _Sides) -> list[TransferState]:
    sides = list(chain.from_iterable(stored.chunks))
    for i, name, value in stored.wide:
        if name not in _MASK_NAMES or not 0 <= i < len(sides):
            raise SnapshotFormatError(f"snapshot names mask {name!r} of side {i} of {len(sides)}")
        setattr(sides[i], name, int.from_bytes(value, "little"))
    return sides


_IdMemoryPlain = tuple[int, int, int, int, int, list[bytes]]


class Document(msgspec.Struct, kw_only=True):
    """A state as a snapshot writes it (`take`): plain data and copies, nothing the fold changes later."""

    format: int
    transfer_fields: list[str]
    transfers: _Sides
    live: list[Key]
    unmapped: list[Key]
    deadlines: list[tuple[float, int, str, TransferId]]
    held: list[tuple[str, list[int]]]
    contested: list[tuple[str, int, list[Key]]]
    double_owned: list[tuple[Key, list[tuple[int, Key, int]]]]
    anomalous: list[Key]
    orphans_expired: list[Key]
    expired_producers: list[Key]
    retrying: list[Key]
    sources: list[str]
    tombstones: list[tuple[Key, Compacted]]
    tombstones_old: list[tuple[Key, Compacted]]
    orphan_tombstones: _Sides
    orphan_tombstones_old: _Sides
    orphan_tombstones_max: int
    orphans_evicted: int
    sides_unchecked: int
    tombstones_max: int
    tombstones_evicted: int
    id_memory: _IdMemoryPlain | None
    late_after_eviction: int
    reused_after_eviction: int
    releases_by_cause: list[tuple[Cause, int]]
    blocks_held: int
    forged_recent: list[Drop] = []
    """The fold's recent `drop` events, oldest first (its bound, `FORGED_KEPT_MAX`, is restored with it)."""
    decided: list[tuple[float, int]] = []
    """(decision ts, the side's index in `transfers`): no key to build and hash again per entry on decoding."""
    counters: dict[str, list[tuple[str, int]]] = {}


class SnapshotFormatError(ValueError):
    """A snapshot this code cannot decode (another format, or the fold's fields changed)."""


class _Format(msgspec.Struct):
    """Only the format of a document: the decoder skips every other field without building it (decoding
    the whole body as plain objects to read one int cost more than decoding the snapshot itself)."""

    format: object = None


# "deterministic" sorts sets, so equal states encode to equal bytes; our dicts are lists already.
_encoder = msgspec.msgpack.Encoder(order="deterministic")
_format_decoder = msgspec.msgpack.Decoder(_Format)
_decoder = msgspec.msgpack.Decoder(Document)


def encode(state: LedgerState) -> bytes:
    return encode_taken(take(state))


def encode_taken(document: Document) -> bytes:
    """What `take` took, encoded (anywhere: it shares nothing with the state it was taken from)."""
    return _encoder.encode(
        msgspec.structs.replace(
            document,
            transfers=_chunks_encoded(document.transfers),
            deadlines=[d[:4] for d in document.deadlines],
            orphan_tombstones=_chunks_encoded(document.orphan_tombstones),
            orphan_tombstones_old=_chunks_encoded(document.orphan_tombstones_old),
        )
    )


def take(state: LedgerState) -> Document:
    """Everything a snapshot writes of `state`, copied as it is now (where the fold cannot move: about a
    sixth of the whole encoding's time), so that the encoding can run while the fold goes on."""
    fields = frozenset(vars(state))
    counters = [name for name in _COUNTER_FIELDS if name in fields]
    changed = sorted((fields - frozenset(counters)) ^ _STATE_FIELDS)
    if changed:
        raise SnapshotFormatError(f"LedgerState fields changed ({changed}): update ledger/store/snapshot.py")
    sides = list(state.transfers.values())
    index = {id(t): i for i, t in enumerate(sides)}  # every side in `decided` is in `transfers` (indexes.py)
    return Document(
        format=FORMAT,
        transfer_fields=list(TransferState.__struct_fields__),
        transfers=_stored(sides),
        live=list(state.live),
        unmapped=list(state.unmapped),
        # The heap's entries as they are, each still holding its side (a copy of the list: what the lock
        # must cover); `encode_taken` writes the first four of each, and decoding finds the sides again.
        deadlines=cast(list[tuple[float, int, str, TransferId]], list(state.deadlines)),
        held=[(source, sorted(blocks)) for source, blocks in state.held.items()],
        contested=[(source, block, list(keys)) for (source, block), keys in state.contested.items()],
        double_owned=[(key, list(owners)) for key, owners in state.double_owned.items()],
        anomalous=list(state.anomalous),
        orphans_expired=list(state.orphans_expired),
        expired_producers=list(state.expired_producers),
        retrying=list(state.retrying),
        sources=list(state.sources),
        tombstones=list(state.tombstones.items()),
        tombstones_old=list(state.tombstones_old.items()),
        orphan_tombstones=_stored(state.orphan_tombstones.values()),
        orphan_tombstones_old=_stored(state.orphan_tombstones_old.values()),
        orphan_tombstones_max=state.orphan_tombstones_max,
        orphans_evicted=state.orphans_evicted,
        sides_unchecked=state.sides_unchecked,
        tombstones_max=state.tombstones_max,
        tombstones_evicted=state.tombstones_evicted,
        id_memory=state.id_memory.to_plain() if state.id_memory is not None else None,
        late_after_eviction=state.late_after_eviction,
        reused_after_eviction=state.reused_after_eviction,
        releases_by_cause=list(state.releases_by_cause.items()),
        blocks_held=state.blocks_held,
        forged_recent=list(state.forged_recent),
        decided=[(ts, index[id(t)]) for ts, _, _, t in state.decided],
        counters={name: list(getattr(state, name).items()) for name in counters},
    )


def document_format(body: bytes | memoryview) -> object:
    """The `format` field of a msgpack map (None if it has none), read without decoding the rest (but
    skipping over it: a fifth of a second for a million events' snapshot, so only to say why one failed)."""
    try:
        return _format_decoder.decode(body).format
    except (msgspec.DecodeError, msgspec.ValidationError) as error:
        raise SnapshotFormatError(f"not a snapshot: {error}") from None


class _Formatted(Protocol):
    format: int


_D = TypeVar("_D", bound=_Formatted)


def decoded(decoder: msgspec.msgpack.Decoder[_D], body: bytes | memoryview, expected: int, what: str) -> _D:
    """`body` decoded, refused (`SnapshotFormatError`, naming `what`) unless it decodes and its `format` is
    `expected`. Decoded first, its format read after: reading the format before skipped over the whole body
    once more, for each document nesting another. A body the decoder refuses is asked its format only then,
    so that the error says "another format" where that is why."""
    try:
        doc = decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as error:
        found = document_format(body)
        if found != expected:
            raise SnapshotFormatError(f"{what} of format {found}, this code reads {expected}") from None
        raise SnapshotFormatError(f"{what} does not decode: {error}") from None
    if doc.format != expected:
        raise SnapshotFormatError(f"{what} of format {doc.format}, this code reads {expected}")
    return doc


def decode(body: bytes | memoryview) -> LedgerState:
    doc = decoded(_decoder, body, FORMAT, "snapshot")
    if doc.transfer_fields != list(TransferState.__struct_fields__):
        raise SnapshotFormatError("TransferState fields changed since the snapshot was written")
    state = LedgerState()
    sides = _restored(doc.transfers)
    state.put_sides(sides)
    transfers = state.transfers
    state.live = {key: transfers[key] for key in doc.live}
    state.unmapped = {key: transfers[key] for key in doc.unmapped}
    state.put_deadlines(doc.deadlines)
    state.held = {source: set(blocks) for source, blocks in doc.held}
    state.contested = {(source, block): keys for source, block, keys in doc.contested}
    state.double_owned = dict(doc.double_owned)
    state.anomalous = dict.fromkeys(doc.anomalous)
    state.orphans_expired = dict.fromkeys(doc.orphans_expired)
    state.expired_producers = dict.fromkeys(doc.expired_producers)
    state.retrying = {key: transfers[key] for key in doc.retrying}
    state.sources = dict.fromkeys(doc.sources)
    state.tombstones = {(source, tid): tomb for (source, tid), tomb in doc.tombstones}
    state.tombstones_old = {(source, tid): tomb for (source, tid), tomb in doc.tombstones_old}
    state.orphan_tombstones = {t.key: t for t in _restored(doc.orphan_tombstones)}
    state.orphan_tombstones_old = {t.key: t for t in _restored(doc.orphan_tombstones_old)}
    state.orphan_tombstones_max = doc.orphan_tombstones_max
    state.orphans_evicted = doc.orphans_evicted
    state.sides_unchecked = doc.sides_unchecked
    state.tombstones_max = doc.tombstones_max
    state.tombstones_evicted = doc.tombstones_evicted
    try:
        state.id_memory = IdMemory.from_plain(doc.id_memory) if doc.id_memory is not None else None
    except ValueError as error:
        raise SnapshotFormatError(f"snapshot id memory: {error}") from None
    state.late_after_eviction = doc.late_after_eviction
    state.reused_after_eviction = doc.reused_after_eviction
    state.releases_by_cause = dict(doc.releases_by_cause)
    state.blocks_held = doc.blocks_held
    state.put_decided(doc.decided, sides)
    state.forged_recent = deque(doc.forged_recent, maxlen=FORGED_KEPT_MAX)
    for name in _COUNTER_FIELDS:
        if hasattr(state, name) != (name in doc.counters):
            raise SnapshotFormatError(f"LedgerState field {name} appeared or went since the snapshot")
        if name in doc.counters:
            setattr(state, name, dict(doc.counters[name]))
    return state
