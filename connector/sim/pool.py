"""An engine's KV block pool, as vLLM's allocator keeps it: a free list and each block's owner."""

from __future__ import annotations

from kvledger.ledger.events import TransferId


class BlockPool:
    """Blocks are handed out last-freed-first, so a block released too early is reused at once and a
    premature release shows up as wrong bytes in the next transfer rather than hiding."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.owner: dict[int, TransferId] = {}
        self.double_frees = 0

    @property
    def held(self) -> int:
        return len(self.owner)

    def allocate(self, count: int, transfer_id: TransferId) -> tuple[int, ...] | None:
        if count > len(self._free):
            return None
        blocks = tuple(self._free.pop() for _ in range(count))
        for block in blocks:
            self.owner[block] = transfer_id
        return blocks

    def free(self, blocks: tuple[int, ...], transfer_id: TransferId) -> None:
        """Give blocks back; a block not held by `transfer_id` is a double free (counted, not freed)."""
        for block in reversed(blocks):
            if self.owner.get(block) != transfer_id:
                self.double_frees += 1
                continue
            del self.owner[block]
            self._free.append(block)
