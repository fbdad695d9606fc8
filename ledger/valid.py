"""What a valid event is: the one definition that ingest, the JSONL reader, the connector's edges
and the store all apply.

An event's fields are typed by `kvledger.ledger.events`; a *valid* event also fits everywhere an event
goes (every store, both encodings, the clock a timeline prints):

- every integer (seq, counts, ranks, and each member of a block or layer list) fits in 64 signed
  bits, and `seq` is at least 1 once a log has assigned it;
- `ts` and a map's `deadline` are seconds in [0, TS_MAX] (no NaN, no infinity);
- `source` and `transfer_id` are 1 to their column's width of characters, and they and a map's
  `request_id` are non-empty and hold no NUL (PostgreSQL's text cannot).

Everything else (layer numbers past any model, ranks, duplicates, order) is the fold's business:
valid but odd events are evidence for findings, never rejected here.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Annotated

import msgspec

from kvledger.ledger.events import Ack, Event, Map, Schedule, Seal, TransferId
from kvledger.ledger.limits import INT64_MAX, INT64_MIN, SOURCE_CHARS_MAX, TRANSFER_ID_CHARS_MAX, TS_MAX

try:
    import cython
except ImportError:  # no Cython here: this module runs as Python
    COMPILED = False
else:
    COMPILED = cython.compiled


class InvalidEvent(ValueError):
    """An event outside the definition above; `field` names the first field that is wrong."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(f"field {field!r}: {message}")


Int64 = Annotated[int, msgspec.Meta(ge=INT64_MIN, le=INT64_MAX)]
"""An integer field of a wire struct that ends up in an event (a peer's rank, a block id)."""

TransferIdText = Annotated[
    TransferId, msgspec.Meta(min_length=1, max_length=TRANSFER_ID_CHARS_MAX, pattern="^[^\x00]*$")
]
"""A transfer id as a wire struct outside the ledger (a peer's message) must carry it."""


def _text(name: str, value: str, chars_max: int | None) -> tuple[str, str] | None:
    if not value:
        return name, "must not be empty"
    if chars_max is not None and len(value) > chars_max:
        return name, f"longer than {chars_max} characters ({len(value)})"
    if "\x00" in value:
        return name, "must not contain NUL characters"
    return None


def text_problem(name: str, value: str) -> tuple[str, str] | None:
    """(field, why) when the identifier `value` of field `name` breaks the rules above, else None."""
    return _text(name, value, _TEXT_CHARS_MAX.get(name))


_TEXT_CHARS_MAX: dict[str, int | None] = {
    "source": SOURCE_CHARS_MAX,
    "transfer_id": TRANSFER_ID_CHARS_MAX,
    "request_id": None,
}


def _time(name: str, value: float) -> tuple[str, str] | None:
    if 0.0 <= value <= TS_MAX:  # False for NaN too
        return None
    return name, f"must be seconds since the epoch in [0, {TS_MAX:.0f}] (9999-12-31), got {value!r}"


def _int(name: str, value: int) -> tuple[str, str] | None:
    if INT64_MIN <= value <= INT64_MAX:
        return None
    return name, f"integer {value} does not fit in 64 bits"


def ints_problem(name: str, values: tuple[int, ...] | None) -> tuple[str, str] | None:
    # min and max run in C: a block list of thousands costs a few microseconds, not a loop.
    if values and (min(values) < INT64_MIN or max(values) > INT64_MAX):
        bad = next(v for v in values if not INT64_MIN <= v <= INT64_MAX)
        return name, f"integer {bad} does not fit in 64 bits"
    return None


def event_problem(event: Event, *, assigned: bool = True) -> tuple[str, str] | None:
    """(field, why) for the first rule `event` breaks, or None when it is valid.

    With `assigned` (the default) the seq must be one a log gave (>= 1); without, 0 (not yet
    assigned) is accepted too. Cheap when the event is valid: a few comparisons per field.
    """
    seq = event.seq
    if not (1 if assigned else 0) <= seq <= INT64_MAX:
        return "seq", f"must be in [{1 if assigned else 0}, {INT64_MAX}], got {seq}"
    found = (
        _time("ts", event.ts)
        or _text("source", event.source, SOURCE_CHARS_MAX)
        or _text("transfer_id", event.transfer_id, TRANSFER_ID_CHARS_MAX)
    )
    if found is not None:
        return found
    kind = type(event)
    if kind is Map:
        m: Map = event  # type: ignore[assignment]
        return (
            _text("request_id", m.request_id, None)
            or ints_problem("block_ids", m.block_ids)
            or ints_problem("remote_block_ids", m.remote_block_ids)
            or ints_problem("block_groups", m.block_groups)
            or ints_problem("remote_block_groups", m.remote_block_groups)
            or _time("deadline", m.deadline)
            or _int("acks_expected", m.acks_expected)
        )
    if kind is Ack:
        a: Ack = event  # type: ignore[assignment]
        return ints_problem("layers", a.layers) or _int("rank", a.rank)
    if kind is Schedule:
        s: Schedule = event  # type: ignore[assignment]
        return ints_problem("layers", s.layers) or _int("attempt", s.attempt)
    if kind is Seal:
        return _int("expected", event.expected)  # type: ignore[union-attr]
    return None  # fail and expire carry no other number or identifier


def check_event(event: Event, *, assigned: bool = True) -> None:
    """Raise `InvalidEvent` naming the field when `event` is not valid (see `event_problem`)."""
    found = event_problem(event, assigned=assigned)
    if found is not None:
        raise InvalidEvent(*found)


_DIGITS_AS_ZERO = bytes.maketrans(b"0123456789", b"0000000000")
_LONG_INTEGER = b"0" * 19
"""Nineteen digits in a row (once every digit reads 0): the shortest JSON number that can exceed 64 bits."""
_NUL_ESCAPE = b"\\u0000"
"""The only way JSON can put a NUL in a string (raw control characters are malformed JSON)."""
_seq, _ts, _source, _transfer_id = attrgetter("seq"), attrgetter("ts"), attrgetter("source"), attrgetter("transfer_id")
_deadline, _request_id = attrgetter("deadline"), attrgetter("request_id")


def json_chunk_valid(events: list[Event], raw: bytes) -> bool:
    """True only if every event decoded from the JSON lines `raw` is valid; False means "look at each".

    The whole chunk at once instead of `event_problem` per event: a replay reads millions. NUL is
    looked for in the bytes (one scan in C); the rest, compiled, in one loop over the events that
    reads their fields as C values (`_each_fits`), and interpreted by min and max over the fields
    and one more scan of the bytes for long integers. It may answer False for a valid chunk (an
    escaped backslash before `u0000`; interpreted, a long digit run in a float), never True for an
    invalid one.
    """
    if not events:
        return True
    if b"\\" in raw and _NUL_ESCAPE in raw:  # a byte is found faster than the escape (memchr)
        return False  # from here on no string holds NUL
    if COMPILED:
        return _each_fits(events)
    if _LONG_INTEGER in raw.translate(_DIGITS_AS_ZERO):  # one pass in C
        return False  # every integer is now below 10**18 in magnitude
    times = list(map(_ts, events))
    sources = list(map(len, map(_source, events)))
    transfer_ids = list(map(len, map(_transfer_id, events)))
    if (
        min(map(_seq, events)) < 1
        or not (min(times) >= 0.0 and max(times) <= TS_MAX)
        or not (min(sources) >= 1 and max(sources) <= SOURCE_CHARS_MAX)
        or not (min(transfer_ids) >= 1 and max(transfer_ids) <= TRANSFER_ID_CHARS_MAX)
    ):
        return False
    maps = [e for e in events if type(e) is Map]
    if maps:
        deadlines = list(map(_deadline, maps))
        if not (min(deadlines) >= 0.0 and max(deadlines) <= TS_MAX) or min(map(len, map(_request_id, maps))) < 1:
            return False
    return True


def events_fit(events: list[Event]) -> bool:
    """True only if `event_problem` finds nothing in any of `events`; False means "look at each" (as
    `json_chunk_valid`, for events that come as objects: a store's append checks a writer's batch at once)."""
    if not _each_fits(events):
        return False
    texts = "".join(map(_transfer_id, events)) + "".join(set(map(_source, events)))
    maps = [e.request_id for e in events if type(e) is Map]
    return "\x00" not in texts and "\x00" not in "".join(maps)


# `json_chunk_valid`'s compiled path: `event_problem`'s rules but NUL, each event read once. Declared in
# ledger/valid.pxd, the fields are read as C struct members (ledger/structs.pxd) and the numbers taken as
# C values: an integer past 64 bits raises OverflowError in the conversion, which answers False. Written
# so that it means the same interpreted (tests/ledger/test_valid.py runs it either way).

_INT64_MIN, _INT64_MAX, _TS_MAX = INT64_MIN, INT64_MAX, TS_MAX
_SOURCE_CHARS_MAX, _TRANSFER_ID_CHARS_MAX = SOURCE_CHARS_MAX, TRANSFER_ID_CHARS_MAX


def _each_fits(events: list[Event]) -> bool:
    try:
        for event in events:
            if type(event) is Ack:
                a = event
                if not (_envelope_fits(a.seq, a.ts, a.source, a.transfer_id) and _ints_fit(a.layers)):
                    return False
                if not _int_fits(a.rank):
                    return False
            elif type(event) is Schedule:
                s = event
                if not (_envelope_fits(s.seq, s.ts, s.source, s.transfer_id) and _ints_fit(s.layers)):
                    return False
                if not _int_fits(s.attempt):
                    return False
            elif type(event) is Map:
                m = event
                if not (
                    _envelope_fits(m.seq, m.ts, m.source, m.transfer_id)
                    and len(m.request_id) >= 1
                    and _ints_fit(m.block_ids)
                    and _ints_fit(m.remote_block_ids)
                    and _ints_fit(m.block_groups)
                    and _ints_fit(m.remote_block_groups)
                    and _time_fits(m.deadline)
                    and _int_fits(m.acks_expected)
                ):
                    return False
            elif type(event) is Seal:
                seal = event
                if not (_envelope_fits(seal.seq, seal.ts, seal.source, seal.transfer_id) and _int_fits(seal.expected)):
                    return False
            elif event_problem(event) is not None:  # fail, expire and drop: the envelope only, and seldom
                return False
    except OverflowError:
        return False
    return True


def _envelope_fits(seq: int, ts: float, source: str, transfer_id: str) -> bool:
    return (
        1 <= seq <= _INT64_MAX
        and _time_fits(ts)
        and 1 <= len(source) <= _SOURCE_CHARS_MAX
        and 1 <= len(transfer_id) <= _TRANSFER_ID_CHARS_MAX
    )


def _time_fits(value: float) -> bool:
    return 0.0 <= value <= _TS_MAX  # False for NaN too


def _int_fits(value: int) -> bool:
    return _INT64_MIN <= value <= _INT64_MAX


def _ints_fit(values: tuple[int, ...] | None) -> bool:
    if values is None:
        return True
    for value in values:  # noqa: SIM110 (a loop: compiled, C; `all` of a generator would not be)
        if not _int_fits(value):
            return False
    return True
