"""Transfers deferred until their peer links: by peer, in arrival order, each with its deadline.

The worker parks a transfer here instead of waiting for a handshake; each poll
resumes those whose peer linked and fails (terminal, the reason naming the peer)
those whose deadline passed. Deadlines are arrival + one constant timeout, so
each peer's queue is in deadline order and a poll looks only at what is due.
"""

from __future__ import annotations

from collections import OrderedDict

from kvledger.connector.links import PeerKey
from kvledger.ledger.events import TransferId


class WaitingRoom:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._by_peer: dict[PeerKey, OrderedDict[TransferId, float]] = {}
        self._peer_of: dict[TransferId, PeerKey] = {}

    def __len__(self) -> int:
        return len(self._peer_of)

    def __contains__(self, tid: object) -> bool:
        return tid in self._peer_of

    def park(self, tid: TransferId, peer: PeerKey, deadline: float) -> bool:
        """Wait for `peer` (a transfer already waiting keeps its first deadline); False when full."""
        if tid in self._peer_of:
            return True
        if len(self._peer_of) >= self.capacity:
            return False
        self._by_peer.setdefault(peer, OrderedDict())[tid] = deadline
        self._peer_of[tid] = peer
        return True

    def peers(self) -> list[PeerKey]:
        return list(self._by_peer)

    def release_peer(self, peer: PeerKey) -> list[TransferId]:
        """Every transfer waiting for `peer` (it linked), in arrival order."""
        queue = self._by_peer.pop(peer, OrderedDict())
        for tid in queue:
            del self._peer_of[tid]
        return list(queue)

    def overdue(self, peer: PeerKey, now: float) -> list[TransferId]:
        """The transfers waiting for `peer` whose deadline has passed (taken out)."""
        queue = self._by_peer.get(peer)
        out: list[TransferId] = []
        while queue:
            tid, deadline = next(iter(queue.items()))
            if deadline > now:
                break
            queue.popitem(last=False)
            del self._peer_of[tid]
            out.append(tid)
        if queue is not None and not queue:
            del self._by_peer[peer]
        return out

    def drop(self, tid: TransferId) -> None:
        """A transfer decided meanwhile (released, expired) stops waiting."""
        peer = self._peer_of.pop(tid, None)
        if peer is not None:
            queue = self._by_peer[peer]
            del queue[tid]
            if not queue:
                del self._by_peer[peer]
