"""The ids of mapped transfer sides retired past the side horizon, remembered exactly.

The fold refuses a second `map` of a `(source, transfer_id)` that was ever mapped (DESIGN.md, "Long
runs"). While a side is held, whole or as a tombstone, that answer comes from the side. A decided side
is retired once its horizon has passed (`ledger.limits.SIDE_HORIZON_S` of log time after its last
event, a rule: see ledger/upkeep.py); from then on its id lives on only here, as the id itself: a
set of transfer ids per source. No hashing, no false positive: a map is refused here exactly when its
side was mapped before, whatever else the log holds, so a replay of one engine's log, of the merged
fleet log and of any partition of either give the same answer.

What it costs: one id per mapped side retired (about 60-90 bytes, a fifth of a tombstone), for the
life of the state. Exact single use of an id for ever needs that much where ids carry no time; a
partitioned fold (`--jobs`) divides it among its partitions.
"""

from __future__ import annotations

from ledger.events import TransferId


class IdMemory:
    """A set of `(source, transfer_id)` keys, exact: ids kept as they are, grouped by source."""

    def __init__(self) -> None:
        self.by_source: dict[str, set[TransferId]] = {}
        self.added = 0
        """Keys held (a counter for reports)."""

    def add(self, source: str, transfer_id: TransferId) -> None:
        ids = self.by_source.get(source)
        if ids is None:
            ids = self.by_source[source] = set()
        before = len(ids)
        ids.add(transfer_id)
        self.added += len(ids) - before

    def contains(self, source: str, transfer_id: TransferId) -> bool:
        ids = self.by_source.get(source)
        return ids is not None and transfer_id in ids

    def to_plain(self) -> list[tuple[str, list[str]]]:
        """Each source's ids, sorted (for snapshots)."""
        return [(source, sorted(ids)) for source, ids in self.by_source.items()]

    @classmethod
    def from_plain(cls, plain: list[tuple[str, list[str]]]) -> IdMemory:
        memory = cls()
        for source, ids in plain:
            memory.by_source[source] = {TransferId(i) for i in ids}
        memory.added = sum(len(ids) for ids in memory.by_source.values())
        return memory
