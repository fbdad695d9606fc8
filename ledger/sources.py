"""Which sources are alive: a source holding blocks that went silent (or whose engine is known dead) is lost.

Leaks are a running engine's blocks pinned past their deadline; a dead engine's blocks went with it. The
ledger cannot see a process die, but it can see a source stop writing: a running connector appends an
`expire` when a deadline passes, so a source that holds blocks and has appended nothing for
`LOST_SILENCE_TRANSFER_TIMEOUTS` transfer timeouts is not running. An operator (or the demo, which killed
the engine itself) may also name engines known dead. One rule, here, for the service and the CLI alike.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol, TypeVar

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


def held_by_source(state: LedgerState) -> dict[str, tuple[int, int]]:
    """Every source of `state` (in first-seen order) with the transfer sides and blocks its live sides hold:
    what `judge` reads of a fold (a partition's add up to the whole fold's: `kvledger.ledger.picture`)."""
    held: dict[str, tuple[int, int]] = dict.fromkeys(state.sources, (0, 0))
    for t in state.live.values():
        sides, blocks = held.get(t.source, (0, 0))
        held[t.source] = (sides + 1, blocks + len(t.block_ids))
    return held


def judge_sources(
    state: LedgerState,
    last_ts: Mapping[str, float],
    now: float,
    *,
    transfer_timeout_s: float,
    dead: Mapping[str, str] | None = None,
) -> dict[str, SourceHealth]:
    """Every source's health at `now`. `dead` names engines (or single sources) known dead, with why."""
    return judge(held_by_source(state), last_ts, now, transfer_timeout_s=transfer_timeout_s, dead=dead)


def judge(
    held: Mapping[str, tuple[int, int]],
    last_ts: Mapping[str, float],
    now: float,
    *,
    transfer_timeout_s: float,
    dead: Mapping[str, str] | None = None,
) -> dict[str, SourceHealth]:
    """Every source's health at `now`, from what each holds (`held_by_source`: sides, blocks) and its newest
    event's ts. `dead` names engines (or single sources) known dead, with why."""
    dead = dead or {}
    limit_s = silence_limit_s(transfer_timeout_s)
    out: dict[str, SourceHealth] = {}
    for source, (sides, blocks) in held.items():
        engine = engine_of(source)
        last = last_ts.get(source, now)
        silent_s = max(0.0, now - last)
        known = dead.get(source, dead.get(engine))
        if known is not None:
            why = f"known dead: {known}" if known else "known dead"
        elif sides and silent_s > limit_s:
            why = (
                f"silent for {duration(silent_s)} while holding blocks, longer than {LOST_SILENCE_TRANSFER_TIMEOUTS}"
                f" transfer timeouts ({duration(limit_s)})"
            )
        else:
            why = ""
        out[source] = SourceHealth(source, engine, last, silent_s, sides, blocks, bool(why), why)
    return out


class _Sided(Protocol):
    @property
    def source(self) -> str: ...


S = TypeVar("S", bound=_Sided)


def oldest_on_live_source(sides: Iterable[S], health: Mapping[str, SourceHealth]) -> S | None:
    """The first of `sides` (live sides in map order: a fold's `state.live`, or a merge's ownership) whose
    source is not lost: the oldest held on a live engine (what a lost engine held went with it)."""
    for t in sides:
        h = health.get(t.source)
        if h is None or not h.lost:
            return t
    return None
