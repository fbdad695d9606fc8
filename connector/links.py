"""Per-peer link state: what the linker knows about one peer rank's handshake.

A link is a completed handshake (the peer's metadata, checked) plus a transport
session with it. Until then a peer rank is in flight (a handshake runs on the
linker's thread) or failed (the reason, and when the next attempt is due). The
worker only ever reads this state; it never waits for it to change.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvledger.connector.layout import Geometry
from kvledger.connector.limits import LINK_GENERATIONS_ENDED_MAX
from kvledger.connector.messages import HandshakeMetadata
from kvledger.connector.transports.base import Session

PeerKey = tuple[str, int]
"""A peer rank by its handshake (host, port)."""


@dataclass
class PeerLink:
    """A completed handshake: the peer's metadata and a transport session with it."""

    metadata: HandshakeMetadata
    session: Session
    geometry: dict[str, Geometry] = field(default_factory=dict)

    @property
    def generation(self) -> int:
        """The life of the peer this link's layout belongs to (0: the peer named none)."""
        return self.metadata.generation


@dataclass
class LinkState:
    """One peer rank: linked, a handshake in flight, or failed `failures` times in a row."""

    link: PeerLink | None = None
    in_flight: bool = False
    failures: int = 0
    reason: str = "not tried yet"
    retry_at: float = 0.0
    """The earliest `now` at which another handshake may start after a failure (the backoff)."""
    attempts: int = 0
    serial: int = 0
    """Links adopted so far: a transfer that asked for a new handshake tells the link it brought from the
    one it doubted."""
    generation: int = 0
    """The generation of the last link adopted (kept when that link is forgotten)."""
    ended: deque[int] = field(default_factory=lambda: deque(maxlen=LINK_GENERATIONS_ENDED_MAX))
    """Generations of this peer rank that a later handshake showed over (the newest last)."""

    def describe(self) -> str:
        if self.link is not None:
            return "linked"
        if self.in_flight:
            return f"handshake in flight (attempt {self.attempts}; last: {self.reason})"
        return f"{self.reason} ({self.failures} failed attempts)"
