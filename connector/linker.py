"""The linker: handshakes with peer ranks off vLLM's step, one at a time per peer, results cached.

`link(peer, now)` never waits: it answers with the link if there is one, and
otherwise makes sure a handshake is under way (a daemon thread per attempt, at
most one per peer rank) unless the last one failed less than a backoff ago. A
thread only runs the channel's handshake (which may block for the handshake
timeout on a dead or silent peer) and leaves its result; `adopt(now)`, called
from the worker's thread at each poll, checks the result (`accept` raises to
refuse it: a redirected endpoint, a bad MAC, a connect that threw) and caches
success and failure alike. A link is kept until the worker `forget`s it: a
transport failure that means the peer is gone, or a transfer naming another life
(generation) of the peer than the link's; the next use handshakes again. A
handshake answered by another generation than the last link's marks that one
ended (`LinkState.ended`). A failure is retried with a backoff doubling from
`LINK_BACKOFF_MIN_S` to `LINK_BACKOFF_MAX_S`, never longer than the transfer
timeout. Transfers waiting for a link are the worker's (`waiting.py`); their
deadline, not the linker, decides when they fail.

Gated (the simulator): results become visible only at `admit()`, the round
boundary, so when a link appears depends on rounds, never on thread timing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvledger.connector.limits import LINK_BACKOFF_MAX_S, LINK_BACKOFF_MIN_S, STOP_JOIN_TIMEOUT_S
from kvledger.connector.links import LinkState, PeerKey, PeerLink
from kvledger.connector.messages import HandshakeMetadata

log = logging.getLogger(__name__)

Handshake = Callable[[str, int], HandshakeMetadata | None]
"""Asks a peer rank for its metadata; may block up to the handshake timeout; None if it did not answer."""

Accept = Callable[[str, int, HandshakeMetadata], PeerLink]
"""Checks a peer's metadata and connects the transport; raises (any exception) to refuse the link."""

_Outcome = HandshakeMetadata | str
"""What a handshake thread leaves: the metadata, or why there is none."""


class Linker:
    def __init__(self, handshake: Handshake, accept: Accept, *, retry_cap_s: float, gated: bool = False) -> None:
        self._handshake = handshake
        self._accept = accept
        self._retry_cap_s = retry_cap_s
        self.gated = gated
        self.states: dict[PeerKey, LinkState] = {}
        self._lock = threading.Lock()
        self._arrived: dict[PeerKey, _Outcome] = {}
        self._admitted: dict[PeerKey, _Outcome] = {}
        self._threads: dict[PeerKey, threading.Thread] = {}
        self._closed = False

    # -- the worker's thread ------------------------------------------------------

    def link(self, peer: PeerKey, now: float) -> PeerLink | None:
        """The link with `peer` if its handshake completed; otherwise None, and a handshake is started
        if none is in flight and the backoff after the last failure has passed. Never waits."""
        state = self.states.get(peer)
        if state is None:
            state = self.states[peer] = LinkState()
        if state.link is not None:
            return state.link
        if not state.in_flight and now >= state.retry_at and not self._closed:
            self._start(peer, state)
        return None

    def describe(self, peer: PeerKey) -> str:
        state = self.states.get(peer)
        return state.describe() if state is not None else "never asked"

    def adopt(self, now: float) -> None:
        """Take the handshakes that finished (gated: those admitted at the last round boundary)."""
        if self.gated:
            outcomes, self._admitted = self._admitted, {}
        else:
            with self._lock:
                outcomes, self._arrived = self._arrived, {}
        for peer, outcome in outcomes.items():
            state = self.states.setdefault(peer, LinkState())
            state.in_flight = False
            if isinstance(outcome, str):
                self._failed(state, outcome, now)
                continue
            try:
                state.link = self._accept(peer[0], peer[1], outcome)
            except Exception as error:  # a refused endpoint, a bad MAC, a transport connect that threw
                self._failed(state, f"{type(error).__name__}: {error}", now)
                continue
            state.failures, state.reason = 0, "linked"
            state.serial += 1
            if state.generation and outcome.generation != state.generation:
                state.ended.append(state.generation)  # the peer answered as another life: the last one is over
                log.warning(
                    "%s:%s restarted (generation %d, was %d): transfers of its previous life fail",
                    peer[0], peer[1], outcome.generation, state.generation,
                )  # fmt: skip
            state.generation = outcome.generation

    def forget(self, peer: PeerKey, link: PeerLink | None = None) -> bool:
        """Drop a link that stopped working (the peer is gone, or restarted): its next use handshakes again, off
        the step. With `link`, only if it is still the current one (a failure of an older session must not drop
        a link handshaken since). True if a link was dropped."""
        state = self.states.get(peer)
        if state is None or state.link is None or (link is not None and state.link is not link):
            return False
        state.link = None
        state.reason = "forgotten: the peer is gone or restarted"
        return True

    def _failed(self, state: LinkState, reason: str, now: float) -> None:
        state.failures += 1
        state.reason = reason
        backoff = min(LINK_BACKOFF_MIN_S * 2 ** (state.failures - 1), LINK_BACKOFF_MAX_S, self._retry_cap_s)
        state.retry_at = now + backoff
        log.warning("handshake failed (%d in a row): %s; next attempt in %.2f s", state.failures, reason, backoff)

    def _start(self, peer: PeerKey, state: LinkState) -> None:
        state.in_flight = True
        state.attempts += 1
        thread = threading.Thread(
            target=self._run, args=(peer,), name=f"kvledger-link-{peer[0]}:{peer[1]}", daemon=True
        )
        self._threads[peer] = thread
        thread.start()

    # -- the handshake threads ------------------------------------------------------

    def _run(self, peer: PeerKey) -> None:
        outcome: _Outcome
        try:
            metadata = self._handshake(peer[0], peer[1])
            outcome = metadata if metadata is not None else "no handshake answer in time"
        except Exception as error:  # PeerNotAllowed, a socket error: a failed attempt, never a crash
            outcome = f"{type(error).__name__}: {error}"
        with self._lock:
            self._arrived[peer] = outcome

    # -- the simulator's round boundary -------------------------------------------------

    def in_flight(self) -> list[PeerKey]:
        return [peer for peer, thread in self._threads.items() if thread.is_alive()]

    def settle(self, deadline: float, skip: Callable[[PeerKey], bool]) -> bool:
        """Wait (until `deadline`, monotonic) for every in-flight handshake but those `skip` names; True if done."""
        for peer, thread in list(self._threads.items()):
            if skip(peer):
                continue
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                return False
        return True

    def admit(self, drop: Callable[[PeerKey], bool]) -> None:
        """Gated: what arrived becomes visible to the next `adopt`; a result `drop` names reads as a failure."""
        with self._lock:
            arrived, self._arrived = self._arrived, {}
        for peer, outcome in arrived.items():
            self._admitted[peer] = "peer died" if drop(peer) else outcome
        self._threads = {peer: t for peer, t in self._threads.items() if t.is_alive() or peer in self._admitted}

    def close(self) -> None:
        self._closed = True
        deadline = time.monotonic() + STOP_JOIN_TIMEOUT_S
        for thread in list(self._threads.values()):
            thread.join(max(0.0, deadline - time.monotonic()))
