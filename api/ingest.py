"""POST /events' rules: decode a batch with the ledger's decoder, check it, find the gaps per source."""

from __future__ import annotations

import msgspec

from api.errors import InvalidBody, msgspec_loc
from api.schemas import Gap
from ledger.events import Event
from ledger.valid import event_problem, json_chunk_valid


class IngestBatch(msgspec.Struct, forbid_unknown_fields=True):
    events: list[Event]


_decoder = msgspec.json.Decoder(IngestBatch)


def decode_batch(body: bytes, events_max: int) -> list[Event]:
    """The batch's events, or `InvalidBody` naming the first field that is wrong.

    Every event must be valid as `ledger.valid` defines it (the same rules the store and the JSONL
    reader apply), so what is accepted here can always be stored and exported."""
    try:
        events = _decoder.decode(body).events
    except (msgspec.ValidationError, msgspec.DecodeError) as error:
        loc, message = msgspec_loc(str(error))
        raise InvalidBody(("body", *loc), message) from None
    if len(events) > events_max:
        raise InvalidBody(("body", "events"), f"{len(events)} events in one batch; the limit is {events_max}")
    # The whole batch checked at once in C when it can be; event by event (to name the field) when not.
    each = not json_chunk_valid(events, body)
    last_seq: dict[str, int] = {}
    for i, event in enumerate(events):
        found = event_problem(event) if each else None
        if found is not None:
            raise InvalidBody(("body", "events", i, found[0]), found[1])
        previous = last_seq.get(event.source, 0)
        if event.seq <= previous:
            raise InvalidBody(
                ("body", "events", i, "seq"),
                f"seq {event.seq} of source {event.source!r} follows seq {previous} in this batch: "
                "a batch must be in increasing seq order per source",
            )
        last_seq[event.source] = event.seq
    return events


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
