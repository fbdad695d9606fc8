"""A real notification channel with faults on the way out and a gate on the way in.

Outgoing: a message whose transfer has a message fault for its type is dropped,
sent twice, or held a number of rounds (reorder, late) and sent when the driver
releases it; a message to a dead engine vanishes (the bytes left, nobody read
them). Incoming: the listener thread queues what arrives as usual, but `drain`
only hands out what the driver admitted at the last round boundary, after every
message sent in that round had arrived. So when a message is seen depends on
rounds, never on thread timing: one sender per inbox keeps ZMQ's FIFO order.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

import zmq

from kvledger.connector.channel import Channel, Dropped, PeerNotAllowed
from kvledger.connector.limits import CHANNEL_INBOX_MAX, FORGED_RECORDS_MAX, HANDSHAKE_TIMEOUT_S
from kvledger.connector.messages import HandshakeMetadata, Message, RankAddress
from kvledger.connector.sim.errors import SimulationError
from kvledger.connector.sim.limits import SETTLE_TIMEOUT_S
from kvledger.connector.sim.network import SimNetwork
from kvledger.ledger.events import TransferId

log = logging.getLogger(__name__)


def message_type(message: Message) -> str:
    tag = type(message).__struct_config__.tag
    assert isinstance(tag, str)
    return tag


class FaultyChannel(Channel):
    def __init__(
        self,
        host: str,
        handshake_port: int,
        notify_port: int,
        may_dial: Callable[[str, int], bool],
        *,
        network: SimNetwork,
        context: zmq.Context[Any] | None = None,
        key: bytes | None = None,
        may_receive_from: Callable[[str], bool] | None = None,
        next_key: bytes | None = None,
        generation: int = 0,
    ) -> None:
        super().__init__(
            host,
            handshake_port,
            notify_port,
            may_dial,
            context=context,
            key=key,
            may_receive_from=may_receive_from,
            next_key=next_key,
            generation=generation,
        )
        self.address = (host, self.notify_port)
        self.network = network
        self.round = 0
        self.sent_to: Counter[tuple[str, int]] = Counter()
        """Messages really handed to ZMQ, per destination: what the receiver must have before a round ends."""
        self.applied: Counter[str] = Counter()
        self.late_sent: dict[TransferId, tuple[str, int]] = {}
        """Transfers whose `late` message was finally sent, and where to (a late_event must show there)."""
        self._held: list[tuple[int, str, int, Message, str]] = []
        self._faulted: set[tuple[TransferId, str]] = set()
        self._admitted: deque[Message] = deque()
        self._admitted_dropped: list[Dropped] = []

    # -- out --------------------------------------------------------------------

    def send(self, host: str, port: int, message: Message) -> bool:
        if not self._may_dial(host, port):
            raise PeerNotAllowed(f"{host}:{port} is not a configured peer")
        tid: TransferId | None = getattr(message, "transfer_id", None)
        kind = message_type(message)
        fault = None
        if tid is not None and (tid, kind) not in self._faulted:
            fault = next((m for m in self.network.faults(tid).messages if m.target == kind), None)
        if fault is None:
            return self._transmit(host, port, message)
        assert tid is not None
        self._faulted.add((tid, kind))  # a fault hits the first message of its type only
        self.applied[fault.kind] += 1
        if fault.kind == "drop":
            return True  # it left this engine and was lost on the wire
        if fault.kind == "duplicate":
            self._transmit(host, port, message)
            return self._transmit(host, port, message)
        self._held.append((self.round + fault.delay_rounds, host, port, message, fault.kind))
        return True

    def _transmit(self, host: str, port: int, message: Message) -> bool:
        if self.network.is_dead(host, port):
            self.counters["sim_sent_to_dead"] += 1
            return True
        sent = super().send(host, port, message)
        if sent:
            self.sent_to[(host, port)] += 1
        return sent

    def release_due(self, round_number: int) -> None:
        """Send the held messages due by `round_number`, oldest first."""
        due = [h for h in self._held if h[0] <= round_number]
        if not due:
            return
        self._held = [h for h in self._held if h[0] > round_number]
        for _, host, port, message, kind in due:
            tid: TransferId | None = getattr(message, "transfer_id", None)
            # A receiver restarted since the transfer started never knew it: no late_event is due there.
            if (
                kind == "late"
                and tid is not None
                and not self.network.is_dead(host, port)
                and self.network.knew(host, port, tid)
            ):
                self.late_sent[tid] = (host, port)
            self._transmit(host, port, message)

    @property
    def held(self) -> int:
        return len(self._held)

    def discard_held(self) -> None:
        """This engine died: what it held back is never sent."""
        self._held.clear()

    def handshake(
        self, host: str, port: int, sender: RankAddress, timeout_s: float = HANDSHAKE_TIMEOUT_S
    ) -> HandshakeMetadata | None:
        if self.network.is_dead(host, port):
            # A dead peer never answers: the real call waits `timeout_s` of real time for nothing, and so
            # does this one (on the linker's thread, never the step's). A restarted engine on the same port
            # may pick the old request up; its answer is not taken, as no answer reached a dead process.
            self.counters["sim_handshake_to_dead"] += 1
            super().handshake(host, port, sender, timeout_s)
            return None
        # A live peer always answers in the simulated world, however slow the machine is: wait as long as a
        # round may take, so that a loaded host never turns into a handshake failure (and another run).
        metadata = super().handshake(host, port, sender, max(timeout_s, SETTLE_TIMEOUT_S))
        if metadata is None:
            raise SimulationError(f"live peer {host}:{port} did not answer a handshake in {SETTLE_TIMEOUT_S} s")
        return metadata

    # -- in ---------------------------------------------------------------------

    def received(self) -> int:
        """Messages the notify port took, whatever became of each (counted once its fate is recorded). Not the
        received and dropped counters: those count the handshake port's refusals too, and a round that
        counted one of those ended before the last notification's drop was recorded (a run one `drop` short)."""
        return self.counters["notify_arrived"]

    def admit(self) -> None:
        """Round boundary: everything that arrived becomes visible to the next `drain`.

        A message naming a transfer this storm never issued came from another program on the host that
        dialed a port the kernel has since given us: counted and dropped, so it cannot change the run."""
        self._admitted_dropped.extend(super().take_dropped())
        transfers = self.network.transfers
        for message in super().drain():
            tid: TransferId | None = getattr(message, "transfer_id", None)
            if tid is not None and tid not in transfers:
                self.counters["sim_foreign_dropped"] += 1
                continue
            self._admitted.append(message)

    def take_dropped(self, limit: int = FORGED_RECORDS_MAX) -> list[Dropped]:
        """The refused messages admitted at the last round boundary (when they are seen depends on rounds)."""
        out, self._admitted_dropped = self._admitted_dropped[:limit], self._admitted_dropped[limit:]
        return out

    @property
    def unread(self) -> int:
        """Messages admitted at the last round boundary that the worker has not drained yet."""
        return len(self._admitted)

    def drain(self, limit: int = CHANNEL_INBOX_MAX) -> list[Message]:
        out: list[Message] = []
        while self._admitted and len(out) < limit:
            out.append(self._admitted.popleft())
        return out
