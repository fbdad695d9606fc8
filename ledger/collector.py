"""The garbage collector paused around bulk work that builds millions of objects and no cycles."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


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
