"""Per source, which live sides hold each block, rebuilt from accepted maps and releases in fold order: the
one cross-transfer rule, `double_owner`, judged where a log is folded in partitions
(`kvledger.ledger.partitioned.Merger`). Each partition tells the merge its accepted maps (`Claim`) and its
releases' sides (`Free`, both in ledger/claims.py) with their positions in the whole stream; the merge feeds
them here in that order.

Compiled by setup.py (ledger/ownership.pxd), reading claims and releases as C structs (ledger/structs.pxd):
the merge runs this once per map and once per release of the whole log in the one parent process, so its
per-item loop is what a `--jobs` replay cannot spread.
Sans-IO, like the fold.
"""

from __future__ import annotations

from kvledger.ledger.audit import Finding, finding_of
from kvledger.ledger.claims import Claim, Free
from kvledger.ledger.decisions import Key


class Ownership:
    """Per source, which live sides hold each block: the fold's claims index (`Indexes._claim_blocks`,
    `_free_blocks`) rebuilt from accepted maps and releases in fold order, for `double_owner` alone.

    Exact, not approximate: a block's claimants are kept in claim order; a second claimant of a held block
    records (block, first claimant, its map seq) against itself, as the fold does, and a release lets go of
    each of its side's blocks once. The finding is the audit's: both sides still live at the end.
    Memory: the live sides' claims."""

    def __init__(self) -> None:
        self.held: dict[str, dict[int, Key | list[Key]]] = {}
        """Per source, each held block's holder, or its holders in claim order where several hold it."""
        self.sides: dict[Key, Claim] = {}
        """The live sides' claims, in the order each side first claimed (a fold's `state.live` order)."""
        self.double_owned: dict[Key, list[tuple[int, Key, int]]] = {}
        """Per live side that claimed a block another live side held: (block, that holder, its map seq)."""

    def feed(self, claims: list[Claim], frees: list[Free]) -> None:
        """Claims and releases, each in index order, taken together in index order (a map that is
        released at once, by the same event, claims first)."""
        n_frees = len(frees)
        j = 0
        for claim in claims:
            at = claim.index
            while j < n_frees:
                free = frees[j]
                if free.index >= at:
                    break
                self._free(free)
                j += 1
            self._claim(claim)
        while j < n_frees:
            self._free(frees[j])
            j += 1

    def _claim(self, c: Claim) -> None:
        source = c.source
        key = (source, c.transfer_id)
        self.sides[key] = c
        if self.double_owned:
            self.double_owned.pop(key, None)  # a side of this key before, forgotten: its claims went with it
        held = self.held.get(source)
        if held is None:
            held = self.held[source] = {}
        # One loop for every case (compiled, each step is a C dict call): a block new to the source is this
        # side's; a block named twice in the map finds this side holding it and is held once.
        blocks = c.block_ids
        for block in blocks:
            holder = held.get(block)
            if holder is None:
                held[block] = key
            elif isinstance(holder, list):
                if key not in holder:
                    self.double_owned.setdefault(key, []).append((block, holder[0], c.map_seq))
                    holder.append(key)
            elif holder != key:
                self.double_owned.setdefault(key, []).append((block, holder, c.map_seq))
                held[block] = [holder, key]

    def _free(self, r: Free) -> None:
        source = r.source
        key = (source, r.transfer_id)
        claim = self.sides.pop(key, None)
        if claim is None:
            return  # a side that claimed no blocks (a never-mapped side's release)
        if self.double_owned:
            self.double_owned.pop(key, None)  # the finding needs both sides live at the end
        held = self.held[source]
        blocks = claim.block_ids
        for block in blocks:  # each block let go of once: a second mention finds it gone
            holder = held.get(block)
            if holder is None:
                continue
            if holder is key:
                del held[block]
            elif isinstance(holder, list):
                if key in holder:
                    holder.remove(key)
                    if len(holder) == 1:
                        held[block] = holder[0]
            elif holder == key:
                key = holder  # the claim's own key: the side's other blocks are then found by identity
                del held[block]

    def findings(self) -> list[Finding]:
        """`double_owner` of each live side that claimed a block another side still live holds."""
        out: list[Finding] = []
        for key, claims in self.double_owned.items():
            c = self.sides[key]
            for block, other_key, map_seq in claims:
                other = self.sides.get(other_key)
                if other is not None:
                    out.append(
                        finding_of(
                            "double_owner", c.source, c.transfer_id, c.request_id, c.block_ids,
                            (other.map_seq, map_seq),
                            f"block {block} also held by live transfer {other.transfer_id}",
                        )
                    )  # fmt: skip
        return out
