"""The notification channel: a listener thread (ROUTER sockets) and allow-listed dialers (DEALER).

One thread per rank listens on two ports: the handshake port answers a
`HandshakeRequest` with this rank's `HandshakeMetadata`; the notify port takes
`remote_blocks`, `write_done`, `write_failed` and `release` messages and queues
them for the worker's next poll. Nothing off the wire can crash the listener:
an oversized, malformed or wrong-version message is counted, logged and dropped.
Dialing is allow-listed: `send` and `handshake` refuse any (host, port) the
configuration (or a completed handshake) did not name. `send` and `handshake`
are called from one thread (the worker's), which owns the outgoing sockets.
"""

from __future__ import annotations

import ipaddress
import logging
import queue
import threading
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from kvledger.connector import messages
from kvledger.connector.limits import (
    CHANNEL_INBOX_MAX,
    CHANNEL_POLL_MS,
    FORGED_RECORDS_MAX,
    HANDSHAKE_TIMEOUT_S,
    MESSAGE_BYTES_HARD_MAX,
    MESSAGE_BYTES_MAX,
    REFUSAL_SENDERS_LOGGED_MAX,
    REFUSALS_LOGGED_PER_SENDER,
    STOP_JOIN_TIMEOUT_S,
)
from kvledger.connector.messages import HandshakeMetadata, HandshakeRequest, Message, RankAddress, Rejected

log = logging.getLogger(__name__)
REFUSED_LOGGER = f"{__name__}.refused"
refused_log = logging.getLogger(REFUSED_LOGGER)
"""Refused (forged, replayed or unlisted) control messages, apart from the channel's other warnings: each is
already a counter and a `drop` event the audit reports, so an operator (or the demo, whose storm forges them
on purpose) can quiet this logger alone and lose nothing."""


class PeerNotAllowed(PermissionError):
    """A dial to a (host, port) that neither the configuration nor a handshake named."""


@dataclass(frozen=True)
class Dropped:
    """A control message refused as not proven: a missing or wrong MAC, or a sender outside the allow-list."""

    message_type: str
    transfer_id: str | None
    sender: str
    reason: str
    """`bad_mac`, `sender_not_allowed` or `wrong_receiver` (signed for another rank: a replay)."""


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _type_of(message: Message) -> str:
    tag = type(message).__struct_config__.tag
    return str(tag)


class Channel:
    def __init__(
        self,
        host: str,
        handshake_port: int,
        notify_port: int,
        may_dial: Callable[[str, int], bool],
        *,
        context: zmq.Context[Any] | None = None,
        key: bytes | None = None,
        may_receive_from: Callable[[str], bool] | None = None,
        next_key: bytes | None = None,
        generation: int = 0,
    ) -> None:
        self._key = key
        self.generation = generation
        """This rank's life (`connector/generation.py`): every message it sends says it, under the MAC."""
        self._next_key = next_key if key is not None else None
        """Also accepted, never signed with: the second key of a rotation (docs/security.md)."""
        self._host = host
        self._any_interface = ipaddress.ip_address(host).is_unspecified if _is_ip(host) else False
        self._may_receive_from = may_receive_from
        self.dropped: deque[Dropped] = deque(maxlen=FORGED_RECORDS_MAX)
        """Refused control messages not yet recorded by the worker (oldest forgotten past the bound)."""
        self._refusals_by_sender: Counter[str] = Counter()
        """Refusals logged so far for each sender (`REFUSALS_LOGGED_PER_SENDER` at most each)."""
        if key is None:
            log.warning(
                "kvledger control messages (remote_blocks, release, handshake) are unauthenticated: "
                "set control_key_env or control_key_file in kv_connector_extra_config to sign them"
            )
        self._own_context = context is None
        self._context: zmq.Context[Any] = context if context is not None else zmq.Context()
        self._may_dial = may_dial
        self.inbox: queue.Queue[Message] = queue.Queue(maxsize=CHANNEL_INBOX_MAX)
        self.counters: Counter[str] = Counter()
        self._metadata: bytes | None = None
        self._stop = threading.Event()
        self._dealers: dict[tuple[str, int], zmq.Socket[Any]] = {}
        self._handshake_socket = self._bind(host, handshake_port)
        self._notify_socket = self._bind(host, notify_port)
        self.handshake_port = self._port_of(self._handshake_socket)
        self.notify_port = self._port_of(self._notify_socket)
        self._thread = threading.Thread(target=self._listen, name=f"kvledger-channel-{self.notify_port}", daemon=True)
        self._thread.start()

    def _bind(self, host: str, port: int) -> zmq.Socket[Any]:
        sock = self._context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        # A guard for memory only: ZMQ drops bigger messages (and the peer) before we see them.
        sock.setsockopt(zmq.MAXMSGSIZE, MESSAGE_BYTES_HARD_MAX)
        if port == 0:
            sock.bind_to_random_port(f"tcp://{host}")
        else:
            sock.bind(f"tcp://{host}:{port}")
        return sock  # type: ignore[no-any-return]

    @staticmethod
    def _port_of(sock: zmq.Socket[Any]) -> int:
        endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
        assert isinstance(endpoint, bytes)
        return int(endpoint.rsplit(b":", 1)[1])

    def set_metadata(self, metadata: HandshakeMetadata) -> None:
        """What this rank answers handshakes with (after its KV caches are registered)."""
        stamped = msgspec.structs.replace(metadata, generation=self.generation)
        self._metadata = messages.encode(messages.sign(stamped, self._key))

    # -- the worker's side ----------------------------------------------------

    def send(self, host: str, port: int, message: Message) -> bool:
        """Queue `message` to (host, port); False (counted) if ZMQ's queue to that peer is full."""
        if not self._may_dial(host, port):
            raise PeerNotAllowed(f"{host}:{port} is not a configured peer")
        sock = self._dealers.get((host, port))
        if sock is None:
            sock = self._context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://{host}:{port}")
            self._dealers[(host, port)] = sock
        addressed = msgspec.structs.replace(message, receiver=f"{host}:{port}", generation=self.generation)
        try:
            sock.send(messages.encode(messages.sign(addressed, self._key)), zmq.NOBLOCK)
        except zmq.Again:
            self.counters["send_dropped_queue_full"] += 1
            log.warning("notification to %s:%s dropped: send queue full", host, port)
            return False
        self.counters["sent"] += 1
        return True

    def handshake(
        self, host: str, port: int, sender: RankAddress, timeout_s: float = HANDSHAKE_TIMEOUT_S
    ) -> HandshakeMetadata | None:
        """Ask the rank at (host, port) for its metadata; None if it does not answer in time."""
        if not self._may_dial(host, port):
            raise PeerNotAllowed(f"{host}:{port} is not a configured peer")
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MESSAGE_BYTES_HARD_MAX)
        try:
            sock.connect(f"tcp://{host}:{port}")
            request = HandshakeRequest(sender=sender, receiver=f"{host}:{port}", generation=self.generation)
            sock.send(messages.encode(messages.sign(request, self._key)))
            if not sock.poll(int(timeout_s * 1000)):
                self.counters["handshake_timeout"] += 1
                return None
            reply = messages.decode(sock.recv())
        finally:
            sock.close(linger=0)
        if not isinstance(reply, HandshakeMetadata):
            self.counters["handshake_bad_reply"] += 1
            log.warning("handshake with %s:%s: unusable reply %r", host, port, reply)
            return None
        if not messages.authentic(reply, self._key, self._next_key):
            self._refuse(reply, f"{host}:{port}", "bad_mac")
            return None
        return reply

    def _refuse(self, message: Message, sender: str, reason: str) -> None:
        # Recorded before it is counted: a reader that sees the count (the simulator's round waits for every
        # message sent to be counted) must find the record too, or take it a round later by chance.
        self.dropped.append(Dropped(_type_of(message), messages.transfer_of(message), sender, reason))
        self.counters[f"dropped_{reason}"] += 1
        logged = self._refusals_by_sender
        if sender not in logged and len(logged) >= REFUSAL_SENDERS_LOGGED_MAX:
            return
        logged[sender] += 1
        if logged[sender] < REFUSALS_LOGGED_PER_SENDER:
            refused_log.warning("%s from %s dropped: %s", _type_of(message), sender, reason)
        elif logged[sender] == REFUSALS_LOGGED_PER_SENDER:
            refused_log.warning(
                "%s from %s dropped: %s; further refusals from %s are counted (dropped_<reason>) and recorded "
                "as drop events, not logged",
                _type_of(message), sender, reason, sender,
            )  # fmt: skip

    def take_dropped(self, limit: int = FORGED_RECORDS_MAX) -> list[Dropped]:
        """The refused messages since the last call, `limit` at most (the worker records each as a `drop`)."""
        out: list[Dropped] = []
        while self.dropped and len(out) < limit:
            try:
                out.append(self.dropped.popleft())
            except IndexError:
                break
        return out

    def drain(self, limit: int = CHANNEL_INBOX_MAX) -> list[Message]:
        out: list[Message] = []
        while len(out) < limit:
            try:
                out.append(self.inbox.get_nowait())
            except queue.Empty:
                break
        return out

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(STOP_JOIN_TIMEOUT_S)
        for sock in self._dealers.values():
            sock.close(linger=0)
        self._dealers.clear()
        if self._own_context:
            self._context.term()

    # -- the listener thread --------------------------------------------------

    def _listen(self) -> None:
        poller = zmq.Poller()
        poller.register(self._handshake_socket, zmq.POLLIN)
        poller.register(self._notify_socket, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                for sock, _ in poller.poll(CHANNEL_POLL_MS):
                    frames = sock.recv_multipart(copy=False)
                    if sock is self._handshake_socket:
                        self._on_handshake(frames)
                    else:
                        try:
                            self._on_notify(frames)
                        finally:  # after its fate is recorded: whoever waits on the count finds that too
                            self.counters["notify_arrived"] += 1
        except zmq.ZMQError as error:
            log.warning("notification listener stopped: %s", error)
        finally:
            self._handshake_socket.close(linger=0)
            self._notify_socket.close(linger=0)

    def _decode(self, frames: list[zmq.Frame], port: int) -> Message | None:
        """The message in `frames`, if it is well formed, from an allow-listed host, and proven by its MAC."""
        if len(frames) != 2:
            self.counters["dropped_malformed"] += 1
            log.warning("notification dropped: %d frames, expected 2", len(frames))
            return None
        message = messages.decode(frames[1].bytes, max_bytes=MESSAGE_BYTES_MAX)
        if isinstance(message, Rejected):
            self.counters[f"dropped_{message.reason}"] += 1
            log.warning("notification dropped (%s): %s", message.reason, message.detail)
            return None
        try:
            sender = str(frames[1].get("Peer-Address"))
        except (zmq.ZMQError, AttributeError):
            sender = "unknown"
        if self._may_receive_from is not None and not self._may_receive_from(sender):
            self._refuse(message, sender, "sender_not_allowed")
            return None
        if not messages.authentic(message, self._key, self._next_key):
            self._refuse(message, sender, "bad_mac")
            return None
        if self._key is not None and not self._addressed_here(message.receiver, port):
            # Proven, but signed for another rank (or port): a recorded message replayed here.
            self._refuse(message, sender, "wrong_receiver")
            return None
        return message

    def _addressed_here(self, receiver: str, port: int) -> bool:
        """Whether a message signed for `receiver` (`host:port`) was meant for this socket at `port`. Bound to
        every interface (0.0.0.0, ::), the channel cannot tell which address a peer dialed: the port decides."""
        host, _, port_text = receiver.rpartition(":")
        if port_text != str(port):
            return False
        return host == self._host or self._any_interface

    def _on_handshake(self, frames: list[zmq.Frame]) -> None:
        message = self._decode(frames, self.handshake_port)
        if message is None:
            return
        if not isinstance(message, HandshakeRequest) or self._metadata is None:
            self.counters["dropped_unexpected"] += 1
            log.warning(
                "handshake port: %s dropped (metadata ready: %s)", type(message).__name__, self._metadata is not None
            )
            return
        self.counters["handshakes_answered"] += 1
        self._handshake_socket.send_multipart([frames[0].bytes, self._metadata])

    def _on_notify(self, frames: list[zmq.Frame]) -> None:
        message = self._decode(frames, self.notify_port)
        if message is None:
            return
        if isinstance(message, HandshakeRequest | HandshakeMetadata):
            self.counters["dropped_unexpected"] += 1
            log.warning("notify port: %s dropped", type(message).__name__)
            return
        try:
            self.inbox.put_nowait(message)
        except queue.Full:
            self.counters["dropped_inbox_full"] += 1
            log.warning("notification dropped: inbox full (%d)", CHANNEL_INBOX_MAX)
            return
        self.counters["received"] += 1
