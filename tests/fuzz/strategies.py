"""Hypothesis strategies for arbitrary, not only well-formed, ledger input.

Events are well-typed (each field has its declared type) but nothing else holds: ids are
drawn from small pools so that sides collide, block and layer lists repeat ids, seqs repeat
and go backwards, kinds come in any order, numbers reach past 64 bits and times past what a
clock can print. `FUZZ_EXAMPLES` (environment) scales every fuzz target for a longer run.
"""

from __future__ import annotations

import os
from typing import Any

import msgspec
from hypothesis import strategies as st

from kvledger.ledger.events import Ack, Drop, Event, Expire, Fail, Map, ReqId, Schedule, Seal, TransferId
from kvledger.ledger.limits import INT64_MAX, LAYERS_MAX, RANKS_MAX

FUZZ_SCALE = float(os.environ.get("FUZZ_EXAMPLES", "1"))
"""Multiplies every fuzz target's example count (1 in CI; e.g. 50 for a long hunt)."""


def examples(count: int) -> int:
    return max(1, int(count * FUZZ_SCALE))


SOURCES = ("p/tp0", "d/tp0")
TRANSFER_IDS = ("a", "b", "c", "d")
REQUEST_IDS = ("r1", "r2", "r3")

small_ints = st.integers(-2, 6)
edge_ints = st.sampled_from([-(1 << 63), -1, 0, 1, LAYERS_MAX - 1, LAYERS_MAX, RANKS_MAX, INT64_MAX])
big_ints = st.sampled_from([1 << 63, 1 << 64, 1 << 70, -(1 << 64)])
any_int = st.one_of(small_ints, small_ints, small_ints, edge_ints, big_ints)
block_ids = st.one_of(st.integers(0, 3), st.integers(0, 3), st.integers(0, 3), edge_ints)
"""Few distinct blocks: claims collide, and a map often names one twice."""
block_lists = st.lists(block_ids, max_size=4).map(tuple)
layer_lists = st.one_of(st.none(), st.lists(st.one_of(st.integers(0, 5), edge_ints), max_size=4).map(tuple))
times = st.one_of(
    st.floats(1000.0, 1100.0),
    st.sampled_from([0.0, -1.0, 2.6e11, 9e11, 1e300, float("inf"), float("-inf"), float("nan")]),
)
sources = st.sampled_from(SOURCES)
transfer_ids = st.sampled_from(TRANSFER_IDS).map(TransferId)


def _envelope() -> dict[str, Any]:
    return {"seq": any_int, "ts": times, "source": sources, "transfer_id": transfer_ids}


maps = st.builds(
    Map,
    **_envelope(),
    request_id=st.sampled_from(REQUEST_IDS).map(ReqId),
    role=st.sampled_from(["producer", "consumer"]),
    mode=st.sampled_from(["read", "write"]),
    block_ids=block_lists,
    deadline=times,
    remote_block_ids=st.one_of(st.none(), block_lists),
    peer=st.one_of(st.none(), st.just("host:1")),
    acks_expected=st.one_of(st.integers(1, 3), st.sampled_from([RANKS_MAX, INT64_MAX, 1 << 70])),
)
schedules = st.builds(
    Schedule, **_envelope(), op=st.sampled_from(["read", "write"]), layers=layer_lists,
    attempt=st.integers(-1, 3), deferred=st.booleans(),
)  # fmt: skip
seals = st.builds(Seal, **_envelope(), expected=st.one_of(st.integers(0, 5), st.just(1 << 70)))
acks = st.builds(
    Ack, **_envelope(), what=st.sampled_from(["write", "read", "release", "recv"]), layers=layer_lists,
    rank=st.one_of(st.integers(-1, 4), edge_ints),
)  # fmt: skip
fails = st.builds(Fail, **_envelope(), reason=st.sampled_from(["boom", "SQ full", ""]), retryable=st.booleans())
expires = st.builds(Expire, **_envelope(), deadline=st.sampled_from(["defer", "transfer"]))

drops = st.builds(
    Drop, **_envelope(), message=st.sampled_from(["release", "remote_blocks", "handshake"]),
    sender=st.sampled_from(["127.0.0.1", "10.0.0.9:7100"]), reason=st.sampled_from(["bad_mac", "sender_not_allowed"]),
)  # fmt: skip

events: st.SearchStrategy[Event] = st.one_of(maps, maps, schedules, seals, acks, acks, fails, expires, drops)
"""Any well-typed event; maps and acks twice as often (they make and close claims)."""


_json = msgspec.json.Encoder()
HEADER = b'{"format":"kvledger","version":1}'


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@st.composite
def _mutated(draw: st.DrawFn, line: bytes) -> bytes:
    """`line` with one byte changed, cut short, or left alone."""
    how = draw(st.sampled_from(["keep", "keep", "flip", "cut"]))
    if not line or how == "keep":
        return line
    i = draw(st.integers(0, len(line) - 1))
    if how == "cut":
        return line[:i]
    return line[:i] + bytes([draw(st.integers(0, 255))]) + line[i + 1 :]


event_lines = events.map(_json.encode).flatmap(_mutated)
"""An event's JSON line (NaN and infinity come out as null), sometimes a byte changed or cut short."""

odd_lines = st.one_of(
    st.binary(max_size=40),
    st.integers(1, 3000).map(_nested),
    st.integers(0, 60).map(
        lambda n: b'{"kind":"seal","seq":1,"ts":1,"source":"p","transfer_id":"t","expected":' + b"9" * n + b"}"
    ),
    st.just(b'{"kind":"ack","seq":1,"ts":1,"source":"p\\u0000","transfer_id":"t","what":"recv"}'),
    st.just(b'{"kind":"ack","seq":1,"ts":1,"source":"C:\\\\u0000","transfer_id":"t","what":"recv"}'),
)
"""Lines no appender writes: random bytes, deep nesting, long numbers, NUL and its look-alike."""

headers = st.one_of(
    st.just(HEADER),
    st.just(HEADER),
    st.integers(1, 3000).map(lambda n: b'{"format":"kvledger","version":1,"meta":{"x":' + _nested(n) + b"}}"),
    st.sampled_from([b"", b"garbage", b'{"format":"kvledger","version":2}', b"SQLite format 3\x00junk"]),
)


@st.composite
def log_bytes(draw: st.DrawFn) -> bytes:
    """A whole incident log as bytes: a header (usually right), then lines of events, odd lines or both."""
    lines = draw(st.lists(st.one_of(event_lines, event_lines, event_lines, odd_lines), max_size=12))
    end = draw(st.sampled_from([b"\n", b"\n", b""]))
    return b"\n".join([draw(headers), *lines]) + end
