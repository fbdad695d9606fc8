"""POST /events' rules: decode a batch with the ledger's decoder, check it, find the gaps per source.

The usual batch (every event valid, each source's seqs rising, none missing) is checked a whole column
at a time in C (`map` over attribute getters); only a batch that fails such a check is walked event by
event, to name the first event and field that is wrong exactly as a walk from the start would.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from concurrent.futures import Executor
from functools import partial
from itertools import islice
from operator import and_, attrgetter, eq, ge, lt

import msgspec

from kvledger.api.errors import InvalidBody, msgspec_loc
from kvledger.api.schemas import Gap
from kvledger.ledger.events import Event
from kvledger.ledger.store.base import Appended, EventStore
from kvledger.ledger.valid import event_problem, json_chunk_valid


class IngestBatch(msgspec.Struct, forbid_unknown_fields=True):
    events: list[Event]


_decoder = msgspec.json.Decoder(IngestBatch)
_source, _seq = attrgetter("source"), attrgetter("seq")


def decode_batch(body: bytes, events_max: int) -> list[Event]:
    """The batch's events, or `InvalidBody` naming the first field that is wrong.

    Every event must be valid as `kvledger.ledger.valid` defines it (the same rules the store and the JSONL
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
    if each or not _rising(list(map(_source, events)), list(map(_seq, events))):
        _first_problem(events, each)
    return events


def _rising(sources: list[str], seqs: list[int]) -> bool:
    """Whether each source's seqs rise strictly in batch order (False: walk the batch to name the event)."""
    if len(sources) < 2:
        return True
    if sources.count(sources[0]) == len(sources):  # one source: the usual batch of one appender
        return all(map(lt, seqs, islice(seqs, 1, None)))
    order = sorted(range(len(sources)), key=sources.__getitem__)  # stable: each source's events in batch order
    by_source, their_seqs = [sources[i] for i in order], [seqs[i] for i in order]
    # No neighbour of the same source whose seq does not rise.
    return not any(map(and_, map(eq, by_source, by_source[1:]), map(ge, their_seqs, their_seqs[1:])))


def _first_problem(events: list[Event], each: bool) -> None:
    """Raise `InvalidBody` for the first event that is invalid (checked when `each`) or out of seq order."""
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


def find_gaps(events: list[Event], stored_max: dict[str, int]) -> list[Gap]:
    """Seq ranges missing before each source's events, given the highest seq already stored per source.

    `events` rise in seq per source (as `decode_batch` returns them)."""
    if _contiguous(events, stored_max):
        return []
    expected: dict[str, int] = {}
    gaps: list[Gap] = []
    for event in events:
        next_seq = expected.get(event.source, stored_max.get(event.source, 0) + 1)
        if event.seq > next_seq:
            gaps.append(Gap(source=event.source, missing_from=next_seq, missing_to=event.seq - 1))
        expected[event.source] = max(next_seq, event.seq + 1)
    return gaps


def _contiguous(events: list[Event], stored_max: dict[str, int]) -> bool:
    """Whether no seq is missing: each source's rising seqs follow on one by one from at most one past its
    highest stored seq (a source's first and last seq are its lowest and highest, as they rise)."""
    sources: list[str] = list(map(_source, events))
    seqs: list[int] = list(map(_seq, events))
    if not sources:
        return True
    if sources.count(sources[0]) == len(sources):  # one source: the usual batch of one appender
        return seqs[0] <= stored_max.get(sources[0], 0) + 1 and seqs[-1] - seqs[0] + 1 == len(seqs)
    lows = dict(zip(reversed(sources), reversed(seqs), strict=True))
    highs = dict(zip(sources, seqs, strict=True))
    counts = Counter(sources)
    return all(
        low <= stored_max.get(source, 0) + 1 and highs[source] - low + 1 == counts[source]
        for source, low in lows.items()
    )


async def append_decoded(appender: Executor, store: EventStore, events: list[Event]) -> Appended:
    """A batch `decode_batch` returned, appended on `appender` (`append_returning`, unchecked: every event was
    checked against kvledger.ledger.valid already, so the store need not check them again)."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(appender, partial(store.append_returning, events, checked=True))
