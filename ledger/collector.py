"""The garbage collector kept off the fold's work: paused around bulk work that builds millions of objects
and no cycles, and kept out of the containers a long-running fold grows, which can hold no cycle."""

from __future__ import annotations

import ctypes
import gc
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

_gc_untrack = ctypes.pythonapi.PyObject_GC_UnTrack if hasattr(ctypes, "pythonapi") else None
if _gc_untrack is not None:
    _gc_untrack.argtypes, _gc_untrack.restype = [ctypes.py_object], None


@contextmanager
def collector_paused() -> Iterator[None]:
    """Pause the collector for the block and put it back as found, errors included. For work that builds
    millions of short-lived or lasting objects and no cycles (a replay's fold, a snapshot's decoding): the
    collector's passes over them would cost more than a tenth of the work and free nothing. The pause is
    process-wide, so only around work that ends."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def untrack(containers: Iterable[object]) -> None:
    """Take each container out of the collector's generations, as CPython itself does with a dict or a tuple
    it finds holding only atomic values. Only for containers of atomic values (ids, numbers, tuples of them,
    sides and events the collector does not track): no cycle can pass through one, so a pass over it can
    free nothing, and a container the collector does not track keeps what it holds alive as any outside
    reference does. Why: a long-running service's fold grows million-entry dicts, sets, lists and deques.
    Sets, lists and deques are always tracked, and a dict that CPython had untracked is tracked again by
    the first insert of a fresh key tuple; each was then walked by every collection of its generation, a
    third of sustained ingest's CPU time (benchmarks/api.py, `ingest_collector_s`). A dict re-tracks itself
    on such an insert: call this again after each batch, while the collector is paused. Where the
    interpreter has no C API (not CPython) it does nothing: only the collector's cost changes."""
    if _gc_untrack is not None:
        for container in containers:
            _gc_untrack(container)
