"""A recorder around a connector core: every hook call is noted, then passed on unchanged (same arguments,
same answer, same exceptions), so the run it watches is the run it would have been."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, cast

from kvledger.connector.scheduler import SchedulerCore
from kvledger.connector.sim.driver import Storm
from kvledger.connector.sim.hook_order import HOOK_NAMES
from kvledger.connector.worker import WorkerCore


@dataclass(frozen=True)
class Call:
    name: str
    args: tuple[Any, ...]
    result: Any


class HookRecorder:
    """Stands in for `wrapped`: a call of a method named in `names` goes to `on_call` once it returned;
    everything else (attributes, other methods) is the wrapped object's own."""

    def __init__(self, wrapped: object, on_call: Callable[[Call], None], names: Collection[str] = HOOK_NAMES) -> None:
        self._wrapped = wrapped
        self._on_call = on_call
        self._names = names

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._wrapped, name)
        if name not in self._names or not callable(attribute):
            return attribute

        def recorded(*args: Any, **kwargs: Any) -> Any:
            result = attribute(*args, **kwargs)
            self._on_call(Call(name, args, result))
            return result

        return recorded


RoundCalls = dict[str, list[tuple[int, Call]]]
"""Per engine name, its hook calls in order, each with the round (1-based) it came in."""


def record_storm(storm: Storm) -> RoundCalls:
    """Put a recorder around both engines' scheduler and worker cores (engines a restart builds later are not
    watched); the lists fill as the storm runs."""
    calls: RoundCalls = {}
    for engine in storm.engines:
        log = calls.setdefault(engine.name, [])

        def note(call: Call, log: list[tuple[int, Call]] = log) -> None:
            log.append((storm.tally.rounds, call))

        engine.scheduler = cast(SchedulerCore, HookRecorder(engine.scheduler, note))
        engine.worker = cast(WorkerCore, HookRecorder(engine.worker, note))
    return calls


def by_round(calls: list[tuple[int, Call]]) -> dict[int, list[Call]]:
    out: dict[int, list[Call]] = {}
    for round_number, call in calls:
        out.setdefault(round_number, []).append(call)
    return out
