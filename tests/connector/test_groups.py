"""`flatten_groups`: the block ids vLLM hands a hook per KV cache group, as the core records them."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvledger.connector.groups import NULL_BLOCK_ID, flatten_groups, window_blocks

block_ids = st.lists(st.one_of(st.just(NULL_BLOCK_ID), st.integers(min_value=1, max_value=10_000)), max_size=12)


@given(st.lists(block_ids, max_size=4), st.booleans())
def test_flat_blocks_are_every_group_without_null_blocks_in_order(per_group: list[list[int]], as_tuples: bool) -> None:
    given_groups = tuple(tuple(g) for g in per_group) if as_tuples else tuple(per_group)
    flat, counts = flatten_groups(given_groups)
    kept = [[b for b in group if b != NULL_BLOCK_ID] for group in per_group]
    assert flat == tuple(b for group in kept for b in group)
    assert type(flat) is tuple and all(type(b) is int for b in flat)
    assert counts == (tuple(len(group) for group in kept) if len(kept) > 1 else None)


def test_one_group_without_a_null_block_is_its_blocks_and_no_counts() -> None:
    assert flatten_groups(([5, 9, 2],)) == ((5, 9, 2), None)
    assert flatten_groups(([0, 5, 0],)) == ((5,), None)
    assert flatten_groups(()) == ((), None)
    assert flatten_groups(([1, 0], [0], [3])) == ((1, 3), (1, 0, 1))


def test_a_window_group_keeps_the_blocks_its_window_covers_after_the_prompt() -> None:
    # A 32-token window over blocks of 16: once 99 tokens are computed, tokens 67.. are in it, so blocks 0-3
    # (tokens 0-63) are wholly behind it and vLLM frees them; block 4 (64-79) holds tokens it still covers.
    per_group = ([1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [15])
    kept = window_blocks(per_group, {1: (32, 16)}, 99)
    assert kept == [[1, 2, 3, 4, 5, 6, 7], [12, 13, 14], [15]]
    assert window_blocks(per_group, {1: (32, 16)}, 20) == list(per_group)  # all of it still in the window
    assert window_blocks(per_group, {}, 99) == list(per_group)
    assert window_blocks(([0, 0, 5],), {0: (4, 4)}, 1000) == [[]]  # never more than the list holds
