"""Which sources are alive: a source holding blocks that went silent (or whose engine is known dead) is lost.

Leaks are a running engine's blocks pinned past their deadline; a dead engine's blocks went with it. The
ledger cannot see a process die, but it can see a source stop writing: a running connector appends an
`expire` when a deadline passes, so a source that holds blocks and has appended nothing for
`LOST_SILENCE_TRANSFER_TIMEOUTS` transfer timeouts is not running. An operator (or the demo, which killed
the engine itself) may also name engines known dead. One rule, here, for the service and the CLI alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvledger.ledger.fold import LedgerState
from kvledger.ledger.humanize import duration
from kvledger.ledger.limits import LOST_SILENCE_TRANSFER_TIMEOUTS


def engine_of(source: str) -> str:
    """`prefill-0/tp1` -> `prefill-0`: a source is an engine's scheduler or one of its worker ranks."""
    return source.split("/", 1)[0]


@dataclass(frozen=True)
class SourceHealth:
    source: str
    engine: str
    last_ts: float
    """The source's newest event (its own clock)."""
    silent_s: float
    """How long it has appended nothing, at the audit time (never negative)."""
    sides_held: int
    blocks_held: int
    lost: bool
    why: str
    """Why it is lost, in words; empty when it is not."""


def silence_limit_s(transfer_timeout_s: float) -> float:
    return LOST_SILENCE_TRANSFER_TIMEOUTS * transfer_timeout_s


def judge_sources(
    state: LedgerState,
    last_ts: Mapping[str, float],
    now: float,
    *,
    transfer_timeout_s: float,
    dead: Mapping[str, str] | None = None,
) -> dict[str, SourceHealth]:
    """Every source's health at `now`. `dead` names engines (or single sources) known dead, with why."""
    dead = dead or {}
    sides: dict[str, int] = {}
    blocks: dict[str, int] = {}
    for t in state.live.values():
        sides[t.source] = sides.get(t.source, 0) + 1
        blocks[t.source] = blocks.get(t.source, 0) + len(t.block_ids)
    limit_s = silence_limit_s(transfer_timeout_s)
    out: dict[str, SourceHealth] = {}
    for source in state.sources:
        engine = engine_of(source)
        last = last_ts.get(source, now)
        silent_s = max(0.0, now - last)
        held = sides.get(source, 0)
        known = dead.get(source, dead.get(engine))
        if known is not None:
            why = f"known dead: {known}" if known else "known dead"
        elif held and silent_s > limit_s:
            why = (
                f"silent for {duration(silent_s)} while holding blocks, longer than {LOST_SILENCE_TRANSFER_TIMEOUTS}"
                f" transfer timeouts ({duration(limit_s)})"
            )
        else:
            why = ""
        out[source] = SourceHealth(source, engine, last, silent_s, held, blocks.get(source, 0), bool(why), why)
    return out
