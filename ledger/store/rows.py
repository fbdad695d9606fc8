"""An event as a row of the events table: envelope columns for the indexes, msgpack body for the rest.

Every event is checked against `kvledger.ledger.valid` on its way in, so the store holds only events
that every backend, both encodings and the clock formatter can take.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from operator import attrgetter
from typing import TypeAlias

from kvledger.ledger.events import EVENT_TYPES, Event, to_json, to_msgpack
from kvledger.ledger.limits import INT64_MAX, INT64_MIN
from kvledger.ledger.store.base import UnstorableEvent
from kvledger.ledger.store.limits import QUARANTINE_REASON_CHARS_MAX
from kvledger.ledger.valid import event_problem

Row: TypeAlias = tuple[str, int, float, str, str, bytes]
"""(source, seq, ts, kind, transfer_id, body) in the column order of INSERT_COLUMNS."""

INSERT_COLUMNS = ("source", "seq", "ts", "kind", "transfer_id", "body")

QuarantineRow: TypeAlias = tuple[float, str, int | None, str, bytes]
"""(created_ts, source, seq, reason, body) in the column order of QUARANTINE_COLUMNS."""

QUARANTINE_COLUMNS = ("created_ts", "source", "seq", "reason", "body")

# A dict lookup by type is several times cheaper than reading the struct config per event.
_KIND_OF: dict[type, str] = {t: str(t.__struct_config__.tag) for t in EVENT_TYPES}
_source, _seq, _ts, _transfer_id = attrgetter("source"), attrgetter("seq"), attrgetter("ts"), attrgetter("transfer_id")


def encode_row(event: Event, index: int | None = None) -> Row:
    """The row for `event`; the body is the whole event, so decoding needs no other column.

    Raises `UnstorableEvent` (with `index`, the event's place in its batch) when the event is not valid."""
    found = event_problem(event)
    if found is not None:
        field, why = found
        if field == "seq" and event.seq == 0:
            why = "the event has no seq: append it to a log first"
        raise UnstorableEvent(f"event {event.source[:80]!r} seq {event.seq}: field {field!r}: {why}", index)
    return checked_row(event)


def checked_row(event: Event) -> Row:
    """The row for an event already checked against `kvledger.ledger.valid`."""
    return (event.source, event.seq, event.ts, _KIND_OF[type(event)], event.transfer_id, to_msgpack(event))


def checked_rows(events: Sequence[Event]) -> list[Row]:
    """`checked_row` of each event, built a column at a time: `map` over attribute getters runs in C, where
    a Python call per event cost most of a 1,000-event ingest batch's encoding."""
    source, seq, ts, transfer_id = map(_source, events), map(_seq, events), map(_ts, events), map(_transfer_id, events)
    kind = map(_KIND_OF.__getitem__, map(type, events))
    return list(zip(source, seq, ts, kind, transfer_id, map(to_msgpack, events), strict=True))


def encode_rows(events: Iterable[Event], *, checked: bool = False) -> list[Row]:
    """`encode_row` of each event; the first invalid one raises with its index. With `checked` the caller
    has checked every event against `kvledger.ledger.valid` already (ingest, the whole batch at once): not again."""
    if checked:
        return checked_rows(events if isinstance(events, Sequence) else list(events))
    return [encode_row(event, i) for i, event in enumerate(events)]


def quarantine_row(event: Event, reason: str) -> QuarantineRow:
    """What the quarantine table keeps of a refused event: whatever every backend can hold."""
    seq = event.seq if INT64_MIN <= event.seq <= INT64_MAX else None
    return (
        time.time(),
        event.source.replace("\x00", "\ufffd"),
        seq,
        reason.replace("\x00", "\ufffd")[:QUARANTINE_REASON_CHARS_MAX],
        to_json(event),
    )
