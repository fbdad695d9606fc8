"""A worker rank's generation: a random number drawn once at its start, an identity of the process's life.

A peer that restarts on the same ports may come back with another KV layout (another `num_blocks`, another
attention backend, another model). What a consumer learnt in a handshake (geometry, region sizes, the
transport session) is true of one life only, so every place that carries it names the life it came from:
the handshake metadata, the tcp transport's endpoint and every request on it, every control message (its
sender's), and the `remote_generations` of the params a producer hands out (one per TP rank, learnt by its
scheduler from its workers). A transfer that names another life than the cached link re-handshakes first; a
read or write against a life that ended is refused, never served with the stale layout. Drawn at start and
never stored: it is not in the ledger's events, and the fold never sees it.
"""

from __future__ import annotations

import secrets

NO_GENERATION = 0
"""Names no life: a peer (or params) that does not say, which is checked against nothing."""

GENERATION_BITS = 53
"""Random bits per generation: exact in a JSON number (an IEEE double), so params through any proxy keep it;
two lives of one rank collide with probability 2**-53."""


def draw_generation() -> int:
    """A fresh generation, never NO_GENERATION."""
    return secrets.randbits(GENERATION_BITS) or 1
