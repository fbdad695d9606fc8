"""vLLM's KV cache groups (hybrid models: full attention beside sliding window or Mamba) as plain data.

A request holds blocks in every group, all from one block pool, so block ids are distinct across
groups. What the core records is their concatenation plus each group's count
(`ledger.events.Map.block_groups`); one group is recorded as before, with no counts.
"""

from __future__ import annotations

from collections.abc import Sequence

NULL_BLOCK_ID = 0
"""vLLM's null block (the block pool's first, `is_null`): a placeholder in a group's list for blocks a
sliding window or Mamba group does not keep. It holds no KV: never moved, held or released."""


def flatten_groups(per_group: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """Block ids of every group without null blocks, concatenated, and each group's count (None: one group)."""
    kept = [tuple(b for b in group if b != NULL_BLOCK_ID) for group in per_group]
    flat = tuple(b for group in kept for b in group)
    return flat, (tuple(len(group) for group in kept) if len(kept) > 1 else None)
