"""vLLM's KV cache groups (hybrid models: full attention beside sliding window or Mamba) as plain data.

A request holds blocks in every group, all from one block pool, so block ids are distinct across
groups. What the core records is their concatenation plus each group's count
(`kvledger.ledger.events.Map.block_groups`); one group is recorded as before, with no counts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import chain

NULL_BLOCK_ID = 0
"""vLLM's null block (the block pool's first, `is_null`): a placeholder in a group's list for blocks a
sliding window or Mamba group does not keep. It holds no KV: never moved, held or released."""


def flatten_groups(per_group: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """Block ids of every group without null blocks, concatenated, and each group's count (None: one group).

    Runs in request_finished and update_state_after_alloc on vLLM's step: a group without a null block (every
    group of a full-attention model) is copied whole, the membership test and the copy both C loops, where a
    generator filtering each block cost 3 us for 16 blocks."""
    kept = [
        tuple(group) if NULL_BLOCK_ID not in group else tuple(b for b in group if b != NULL_BLOCK_ID)
        for group in per_group
    ]
    if len(kept) < 2:
        return (kept[0] if kept else ()), None
    return tuple(chain.from_iterable(kept)), tuple(map(len, kept))


def window_blocks(
    per_group: Sequence[Sequence[int]], windows: Mapping[int, tuple[int, int]], computed_tokens: int
) -> list[Sequence[int]]:
    """Each sliding-window group's block list cut to the blocks its window still covers once `computed_tokens`
    are computed; other groups unchanged. `windows[group]`: (window tokens, block size).

    A WRITE producer is given its blocks when they are allocated, before the prompt's forward: a window group
    then lists every block of the prompt, and vLLM frees those left behind by the window right after that
    step (vLLM's null block takes their place). The producer holds, and so records, only those that stay:
    what a consumer that loads `computed_tokens` allocates for the same group, at the list's tail."""
    if not windows:
        return list(per_group)
    kept: list[Sequence[int]] = []
    for index, blocks in enumerate(per_group):
        window = windows.get(index)
        if window is None:
            kept.append(blocks)
            continue
        tokens, block_size = window
        behind = max(0, computed_tokens - tokens + 1) // block_size  # blocks wholly before the window
        kept.append(blocks[min(behind, len(blocks)) :])
    return kept
