"""An event as a row of the events table: envelope columns for the indexes, msgpack body for the rest."""

from __future__ import annotations

from typing import TypeAlias

from ledger.events import EVENT_TYPES, Event, to_msgpack
from ledger.limits import SOURCE_CHARS_MAX, TRANSFER_ID_CHARS_MAX
from ledger.store.base import StoreError

Row: TypeAlias = tuple[str, int, float, str, str, bytes]
"""(source, seq, ts, kind, transfer_id, body) in the column order of INSERT_COLUMNS."""

INSERT_COLUMNS = ("source", "seq", "ts", "kind", "transfer_id", "body")

# A dict lookup by type is several times cheaper than reading the struct config per event.
_KIND_OF: dict[type, str] = {t: str(t.__struct_config__.tag) for t in EVENT_TYPES}


def encode_row(event: Event) -> Row:
    """The row for `event`; the body is the whole event, so decoding needs no other column."""
    if event.seq < 1:
        raise StoreError(f"event of {event.source!r} has no seq (got {event.seq}): append it to a log first")
    if len(event.source) > SOURCE_CHARS_MAX or len(event.transfer_id) > TRANSFER_ID_CHARS_MAX:
        raise StoreError(
            f"event {event.source!r} seq {event.seq}: source or transfer id longer than "
            f"{SOURCE_CHARS_MAX} / {TRANSFER_ID_CHARS_MAX} characters"
        )
    return (event.source, event.seq, event.ts, _KIND_OF[type(event)], event.transfer_id, to_msgpack(event))
