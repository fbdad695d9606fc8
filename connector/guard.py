"""Every vLLM hook behind one guard: an exception never escapes into vLLM's step.

A bug or a peer's surprise inside a hook must cost at most the transfers it
touches, never the engine: the guard logs the exception with the hook's name,
counts it (`hook_errors`, shown in the connector's stats), and answers vLLM with
the hook's neutral value (no external tokens, nothing finished, no metadata).
It also counts calls that took longer than the hook bound (`hooks_over_bound`):
nothing in a hook waits on a peer, so one that did is a bug to see.
Faults that belong to one transfer (a transport that raises, a handshake that
fails) are caught where they happen and become that transfer's `fail` event;
this guard is the last line, for what nobody foresaw.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from kvledger.connector.limits import HOOK_CALL_BOUND_S

log = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")

hook_errors: Counter[str] = Counter()
"""Exceptions each hook swallowed in this process (by hook name)."""

hooks_over_bound: Counter[str] = Counter()
"""Calls of each hook that took longer than `HOOK_CALL_BOUND_S` (the first one of each hook is logged)."""


def guarded(neutral: Callable[[], Any]) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Run the hook; on any exception log and count it and return `neutral()` instead."""

    def wrap(hook: Callable[P, R]) -> Callable[P, R]:
        name = hook.__name__

        @functools.wraps(hook)
        def call(*args: P.args, **kwargs: P.kwargs) -> R:
            start = time.perf_counter()
            try:
                return hook(*args, **kwargs)
            except Exception:
                hook_errors[name] += 1
                log.exception("kvledger connector hook %s raised; vLLM gets its neutral answer", name)
                return neutral()  # type: ignore[no-any-return]
            finally:
                took_s = time.perf_counter() - start
                if took_s > HOOK_CALL_BOUND_S:
                    hooks_over_bound[name] += 1
                    if hooks_over_bound[name] == 1:
                        log.warning(
                            "kvledger hook %s took %.1f ms (bound %.0f ms)", name, took_s * 1e3, HOOK_CALL_BOUND_S * 1e3
                        )

        return call

    return wrap


def nothing() -> None:
    return None
