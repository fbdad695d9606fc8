"""Fold the engines' incident logs (every *.jsonl in a folder), merged, the way `kvledger replay` does."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from kvledger.ledger.audit import Finding, audit
from kvledger.ledger.decisions import Key, Release
from kvledger.ledger.fold import LedgerState
from kvledger.ledger.jsonl import read_chunks
from kvledger.ledger.merge import merge_chunks
from kvledger.ledger.replay import replay_chunks


@dataclass
class FoldedLogs:
    state: LedgerState
    releases: list[Release]
    findings: list[Finding]

    def mapped_sides(self) -> set[Key]:
        return {key for key, t in self.state.transfers.items() if t.mapped}

    def releases_per_side(self) -> Counter[Key]:
        return Counter((r.source, r.transfer_id) for r in self.releases)

    def causes(self, source_prefix: str) -> Counter[str]:
        return Counter(r.cause for r in self.releases if r.source.startswith(source_prefix))


def fold_logs(folder: Path, *, only: str = "") -> FoldedLogs:
    """Merge and fold the logs whose file name starts with `only` (all by default); audit at the last event."""
    paths = sorted(p for p in folder.glob(f"{only}*.jsonl"))
    assert paths, f"no incident logs in {folder}"
    result = replay_chunks(merge_chunks([read_chunks(p) for p in paths], [str(p) for p in paths]), compact_every=None)
    now = result.last_ts or 0.0
    return FoldedLogs(result.state, result.releases, audit(result.state, now))


def assert_clean(folded: FoldedLogs) -> None:
    """Every mapped side of every transfer released exactly once; nothing live; no audit finding at all."""
    per_side = folded.releases_per_side()
    assert set(per_side) == folded.mapped_sides(), "a mapped side was never released (or one was never mapped)"
    assert set(per_side.values()) == {1}, f"released more than once: {per_side}"
    assert not folded.state.live
    assert folded.findings == [], folded.findings
