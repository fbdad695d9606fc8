"""The chunked merge gives exactly `heapq.merge`'s order, wherever the chunks fall."""

from __future__ import annotations

import heapq
import random

import pytest

from kvledger.ledger.events import Event
from kvledger.ledger.merge import OverlapError, merge, merge_chunks
from tests.ledger.builders import Side


def _reference(streams: list[list[Event]]) -> list[Event]:
    """The order the merge promises, written the obvious way (one generator step per event)."""
    tagged = [[(e.ts, e.source, e.seq, i, e) for e in stream] for i, stream in enumerate(streams)]
    return [item[4] for item in heapq.merge(*tagged, key=lambda item: item[:4])]


def _streams(rng: random.Random) -> list[list[Event]]:
    """Logs of one or two sources each, with clocks that sometimes step back."""
    streams = []
    for i in range(rng.randint(1, 4)):
        sides = [Side(f"src-{i}-{k}", start_ts=rng.uniform(0, 1)) for k in range(rng.randint(1, 2))]
        stream = []
        for _ in range(rng.randint(0, 60)):
            side = rng.choice(sides)
            step = rng.choice([0.0, 0.001, 0.01, 0.05, -0.03])  # ties and steps back included
            stream.append(side.ack("t", "recv", ts=side.ts + step))
        streams.append(stream)
    return streams


def _chunked(stream: list[Event], rng: random.Random) -> list[list[Event]]:
    chunks, i = [], 0
    while i < len(stream):
        n = rng.randint(0, 7)  # empty chunks too: a chunk of skipped bad lines
        chunks.append(stream[i : i + n])
        i += n
    return chunks


@pytest.mark.parametrize("seed", range(40))
def test_chunked_merge_equals_the_reference_order(seed: int) -> None:
    rng = random.Random(seed)
    streams = _streams(rng)
    expected = _reference(streams)
    size = rng.randint(1, 9)
    out = list(merge_chunks([_chunked(s, rng) for s in streams], size=size))
    assert all(0 < len(chunk) <= size for chunk in out)
    assert [e for chunk in out for e in chunk] == expected
    assert list(merge(streams)) == expected


def test_a_step_back_in_one_source_keeps_that_source_in_its_order() -> None:
    p, c = Side("p", start_ts=10.0), Side("c", start_ts=10.0)
    left = [p.ack("t", "recv", ts=10.0), p.ack("t", "recv", ts=9.0), p.ack("t", "recv", ts=10.2)]
    right = [c.ack("t", "recv", ts=9.5), c.ack("t", "recv", ts=10.1)]
    merged = [(e.source, e.seq) for e in merge([left, right])]
    assert merged == [("c", 1), ("p", 1), ("p", 2), ("c", 2), ("p", 3)]


def test_out_of_order_seqs_in_one_input_are_refused() -> None:
    p = Side("p")
    first, second = p.ack("t", "recv"), p.ack("t", "recv")
    with pytest.raises(OverlapError, match="out of order in input 1"):
        list(merge_chunks([[[second], [first]]]))
