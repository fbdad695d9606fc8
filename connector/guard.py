"""Every vLLM hook behind one guard: an exception never escapes into vLLM's step.

A bug or a peer's surprise inside a hook must cost at most the transfers it
touches, never the engine: the guard logs the exception with the hook's name,
counts it (`hook_errors`, shown in the connector's stats), and answers vLLM with
the hook's neutral value (no external tokens, nothing finished, no metadata).
Faults that belong to one transfer (a transport that raises, a handshake that
fails) are caught where they happen and become that transfer's `fail` event;
this guard is the last line, for what nobody foresaw.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

log = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")

hook_errors: Counter[str] = Counter()
"""Exceptions each hook swallowed in this process (by hook name)."""


def guarded(neutral: Callable[[], Any]) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Run the hook; on any exception log and count it and return `neutral()` instead."""

    def wrap(hook: Callable[P, R]) -> Callable[P, R]:
        name = hook.__name__

        @functools.wraps(hook)
        def call(*args: P.args, **kwargs: P.kwargs) -> R:
            try:
                return hook(*args, **kwargs)
            except Exception:
                hook_errors[name] += 1
                log.exception("kvledger connector hook %s raised; vLLM gets its neutral answer", name)
                return neutral()  # type: ignore[no-any-return]

        return call

    return wrap


def nothing() -> None:
    return None
