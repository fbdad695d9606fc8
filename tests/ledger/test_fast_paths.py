"""The fold's fast paths (a WRITE layer ack, a first layer schedule, on a 64-bit mask) decide exactly what
the general path does: the same histories are folded as they are, and with every layer number moved
past 63, where no fast path can be taken. Run on both builds (CI runs tests/ledger interpreted too)."""

from __future__ import annotations

import random

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.ledger.events import Ack, Event, Schedule
from kvledger.ledger.fold import LedgerState, fold_all
from kvledger.ledger.limits import LAYERS_MAX
from kvledger.ledger.side import count64, layers_mask, low_layers_mask
from kvledger.ledger.synth import SynthConfig, generate
from tests.ledger.builders import Side
from tests.ledger.histories import history

P = "prefill-0/tp0"
T = "tx-1"

SHIFT = 64
"""Every valid layer moved by this: past the fast paths' 64-bit masks, inside LAYERS_MAX (the invalid ones,
negative or past LAYERS_MAX, the histories' evidence of a bad appender, stay as they are)."""


@given(st.lists(st.one_of(st.integers(-3, 70), st.integers(-(2**80), 2**80)), max_size=9))
def test_low_layers_mask_is_layers_mask_below_64_and_zero_otherwise(layers: list[int]) -> None:
    found = low_layers_mask(tuple(layers))
    if layers and all(0 <= layer < 64 for layer in layers):
        assert found == layers_mask(tuple(layers))
    else:
        assert found == 0


@given(st.integers(0, 2**64 - 1))
def test_count64_counts_the_set_bits_of_a_64_bit_mask(mask: int) -> None:
    """The fast path's count of acked layers, compiled C arithmetic, is `int.bit_count` up to 64 bits."""
    assert count64(mask) == mask.bit_count()


def _shifted(event: Event) -> Event:
    if isinstance(event, (Ack, Schedule)) and event.layers is not None:
        moved = tuple(layer + SHIFT if 0 <= layer < LAYERS_MAX else layer for layer in event.layers)
        return msgspec.structs.replace(event, layers=moved)
    return event


def _outcome(events: list[Event]) -> tuple[list[tuple[object, ...]], dict[object, tuple[object, ...]]]:
    state, releases = fold_all(events, LedgerState())
    decided = [(r.source, r.transfer_id, r.cause, r.seq, r.why, r.reason) for r in releases]
    sides = {
        key: (t.phase, t.acked_mask.bit_count(), t.early_mask.bit_count(), t.duplicate_seqs, t.over_ack_seqs,
              t.late_seqs, sorted(state.anomalous).count(key))
        for key, t in state.transfers.items()
    }  # fmt: skip
    return decided, sides


def _histories() -> list[list[Event]]:
    out = [history(seed) for seed in range(40)]
    rng = random.Random(5)
    for seed in range(6):
        cfg = SynthConfig(
            transfers=60, concurrency=16, layers=48, layers_per_step=rng.choice((1, 3, 8)), fault_rate=0.3
        )
        out.append(list(generate(cfg, seed=seed)))
    return out


def test_shifted_layers_take_the_general_path_and_decide_the_same() -> None:
    histories = _histories()
    named = [e.layers or () for events in histories for e in events if isinstance(e, (Ack, Schedule))]
    layers = [layer for tupled in named for layer in tupled]
    assert not [layer for layer in layers if LAYERS_MAX - SHIFT <= layer < LAYERS_MAX]  # moved, they stay valid
    assert any(0 <= layer < 64 for layer in layers) and any(layer >= LAYERS_MAX for layer in layers)
    for events in histories:
        assert _outcome(events) == _outcome([_shifted(e) for e in events])


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32))
def test_shifted_layers_decide_the_same_on_random_histories(seed: int) -> None:
    events = history(seed)
    assert _outcome(events) == _outcome([_shifted(e) for e in events])


def test_a_side_with_layers_past_63_already_takes_the_general_path_for_low_layers_too() -> None:
    """A side of a model of more than 64 layers: once a layer past 63 is scheduled, its mask no longer fits
    the fast paths' 64-bit integers, and a later schedule or ack of a low layer takes the handler's path (the
    compiled fast path must not raise or drop a bit). The same history with that layer moved below 64
    decides the same."""

    def events(high: int) -> list[Event]:
        side = Side(P)
        return [
            side.map(T, "r", role="producer", mode="write"),
            side.schedule(T, layers=(high,), op="write"),
            side.schedule(T, layers=(1,), op="write"),
            side.ack(T, what="write", layers=(1,)),
            side.seal(T, expected=2),
            side.ack(T, what="write", layers=(high,)),
        ]

    wide, narrow = events(high=100), events(high=6)
    state, releases = fold_all(wide, LedgerState())
    assert [(r.cause, r.why) for r in releases] == [("completed", "completed")]
    side = state.transfers[(P, T)]
    assert side.scheduled_mask == side.acked_mask == (1 << 100) | (1 << 1)
    assert _outcome(wide) == _outcome(narrow)
