"""The lifecycle of one transfer side: its phases and the table of every phase change.

    unmapped --map--> held --schedule--> active --seal--> sealed
       |               |  \\________________seal____________^  |
       +--expire-->  expired          (decisions, from any of held, active, sealed:
                                        completed / failed / expired)

`TRANSITIONS[(phase, trigger)]` is the phase after `trigger`: an event kind, or a decision
(`completed`, `failed`, `expired`) that a guard in the fold took. Every phase change the fold
makes is a lookup here. A pair that is not in the table (any event after a terminal phase, a
decision for a side that is not held) is not a phase change: the fold records the event as
evidence for an audit finding (late, duplicate, reused id) and the phase stays as it was.
"""

from __future__ import annotations

from typing import Final, Literal, TypeAlias

from kvledger.ledger.decisions import Cause
from kvledger.ledger.events import Mode, Role

PhaseName: TypeAlias = Literal["unmapped", "held", "active", "sealed", "completed", "failed", "expired"]


class Phase:
    """Phase names. Plain strings, not an Enum: Enum hashing runs Python code, and the
    table lookup below is on the hot path of every event."""

    UNMAPPED: Final[PhaseName] = "unmapped"
    HELD: Final[PhaseName] = "held"
    ACTIVE: Final[PhaseName] = "active"
    SEALED: Final[PhaseName] = "sealed"
    COMPLETED: Final[PhaseName] = "completed"
    FAILED: Final[PhaseName] = "failed"
    EXPIRED: Final[PhaseName] = "expired"
    ALL: Final[tuple[PhaseName, ...]] = (
        "unmapped", "held", "active", "sealed", "completed", "failed", "expired",
    )  # fmt: skip


TERMINAL: Final[frozenset[PhaseName]] = frozenset({Phase.COMPLETED, Phase.FAILED, Phase.EXPIRED})
"""Phases no event leaves: a side in one is `closed`, and its later events are evidence."""

_U, _H, _A, _S = Phase.UNMAPPED, Phase.HELD, Phase.ACTIVE, Phase.SEALED
_C, _F, _E = Phase.COMPLETED, Phase.FAILED, Phase.EXPIRED

TRANSITIONS: Final[dict[tuple[PhaseName, str], PhaseName]] = {
    # Before its map a side only gathers evidence; giving up on it (expire) ends it.
    (_U, "map"): _H, (_U, "schedule"): _U, (_U, "seal"): _U, (_U, "ack"): _U, (_U, "fail"): _U,
    (_U, "expire"): _E,
    # Held: a second map is refused (evidence), acks and transient fails gather, an expire
    # decides (the `expired` row below).
    (_H, "map"): _H, (_H, "schedule"): _A, (_H, "seal"): _S, (_H, "ack"): _H, (_H, "fail"): _H,
    (_H, "expire"): _H,
    (_A, "map"): _A, (_A, "schedule"): _A, (_A, "seal"): _S, (_A, "ack"): _A, (_A, "fail"): _A,
    (_A, "expire"): _A,
    (_S, "map"): _S, (_S, "schedule"): _S, (_S, "seal"): _S, (_S, "ack"): _S, (_S, "fail"): _S,
    (_S, "expire"): _S,
    # Decisions: the guards' outcomes, from any held phase.
    (_H, "completed"): _C, (_A, "completed"): _C, (_S, "completed"): _C,
    (_H, "failed"): _F, (_A, "failed"): _F, (_S, "failed"): _F,
    (_H, "expired"): _E, (_A, "expired"): _E, (_S, "expired"): _E,
}  # fmt: skip
"""(phase, event kind or decision) -> phase. Terminal phases have no row: what reaches them is evidence."""

NEXT_PHASE: Final[dict[str, dict[PhaseName, PhaseName]]] = {}
for (_phase, _trigger), _next in TRANSITIONS.items():
    NEXT_PHASE.setdefault(_trigger, {})[_phase] = _next
"""TRANSITIONS by trigger, then phase: the same table, looked up without building a tuple per event."""

DECIDED: Final[dict[Cause, dict[PhaseName, PhaseName]]] = {
    "completed": NEXT_PHASE["completed"],
    "failed": NEXT_PHASE["failed"],
    "expired": NEXT_PHASE["expired"],
}
"""The decision rows of the table, by cause."""

ACKS_A_SIDE_RECEIVES: Final[frozenset[tuple[Role, Mode, str]]] = frozenset({
    ("producer", "read", "release"),
    ("producer", "write", "write"),
    ("producer", "write", "release"),
    ("producer", "read", "lease"),
    ("producer", "write", "lease"),
    ("consumer", "read", "read"),
    ("consumer", "read", "recv"),
    ("consumer", "write", "recv"),
    ("consumer", "write", "write"),
})  # fmt: skip
"""(role, mode, ack kind) that fit: producers see writes and releases, consumers reads and recv."""

CAUSE_PHASE: Final[dict[Cause, PhaseName]] = {cause: rows[Phase.HELD] for cause, rows in DECIDED.items()}
"""The phase a decision leaves a side in (the table gives the same one from every held phase)."""
