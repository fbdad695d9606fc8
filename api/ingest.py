"""POST /events' rules: decode a batch with the ledger's decoder, check it, find the gaps per source."""

from __future__ import annotations

import math

import msgspec

from api.errors import InvalidBody, msgspec_loc
from api.event_schema import INT64_MAX, INT64_MIN
from api.schemas import Gap
from ledger.events import Event
from ledger.limits import SOURCE_CHARS_MAX, TRANSFER_ID_CHARS_MAX

TS_MAX = 1e12
"""Seconds since the epoch; anything larger is a unit mistake (milliseconds), not a time."""


class IngestBatch(msgspec.Struct, forbid_unknown_fields=True):
    events: list[Event]


_decoder = msgspec.json.Decoder(IngestBatch)


def decode_batch(body: bytes, events_max: int) -> list[Event]:
    """The batch's events, or `InvalidBody` naming the first field that is wrong."""
    if b"\\u0000" in body:
        raise InvalidBody(("body",), "NUL characters are not allowed in strings")
    try:
        events = _decoder.decode(body).events
    except (msgspec.ValidationError, msgspec.DecodeError) as error:
        loc, message = msgspec_loc(str(error))
        raise InvalidBody(("body", *loc), message) from None
    if len(events) > events_max:
        raise InvalidBody(("body", "events"), f"{len(events)} events in one batch; the limit is {events_max}")
    last_seq: dict[str, int] = {}
    for i, event in enumerate(events):
        _check_event(i, event)
        previous = last_seq.get(event.source, 0)
        if event.seq <= previous:
            raise InvalidBody(
                ("body", "events", i, "seq"),
                f"seq {event.seq} of source {event.source!r} follows seq {previous} in this batch: "
                "a batch must be in increasing seq order per source",
            )
        last_seq[event.source] = event.seq
    return events


def _check_event(i: int, event: Event) -> None:
    def bad(field: str, message: str) -> InvalidBody:
        return InvalidBody(("body", "events", i, field), message)

    if event.seq < 1:
        raise bad("seq", f"must be >= 1 (the appender's log assigns it), got {event.seq}")
    for name in ("source", "transfer_id", "request_id"):
        value = getattr(event, name, None)
        if value is not None and not value:
            raise bad(name, "must not be empty")
    for name, chars_max in (("source", SOURCE_CHARS_MAX), ("transfer_id", TRANSFER_ID_CHARS_MAX)):
        if len(getattr(event, name)) > chars_max:
            raise bad(name, f"longer than {chars_max} characters")
    for name in ("ts", "deadline"):
        value = getattr(event, name, None)
        if isinstance(value, float) and not (math.isfinite(value) and 0 <= value <= TS_MAX):
            raise bad(name, f"must be seconds since the epoch in [0, {TS_MAX:g}], got {value}")
    for name in event.__struct_fields__:
        value = getattr(event, name)
        numbers = value if isinstance(value, tuple) else (value,)
        for number in numbers:
            if type(number) is int and not INT64_MIN <= number <= INT64_MAX:
                raise bad(name, f"integer {number} does not fit in 64 bits")


def find_gaps(events: list[Event], stored_max: dict[str, int]) -> list[Gap]:
    """Seq ranges missing before each source's events, given the highest seq already stored per source."""
    expected: dict[str, int] = {}
    gaps: list[Gap] = []
    for event in events:
        next_seq = expected.get(event.source, stored_max.get(event.source, 0) + 1)
        if event.seq > next_seq:
            gaps.append(Gap(source=event.source, missing_from=next_seq, missing_to=event.seq - 1))
        expected[event.source] = max(next_seq, event.seq + 1)
    return gaps
