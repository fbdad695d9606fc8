"""The port layout: one formula for listeners and dialers, and which ranks hold whose KV.

Every engine has three base ports (handshake, notify, transport). Rank `(dp, tp)`
of an engine with `tp_size` ranks per DP replica listens on `base + dp * tp_size + tp`,
and a dialer computes the very same number from the peer's configuration. MoRIIO
bound listeners at `base + dp + tp` but dialed `base + dp * tp_size + tp`; the two
agree only when `dp == 0` or `tp_size == 1`. Here both sides call `rank_port`.
"""

from __future__ import annotations

import random
import socket

from kvledger.connector.limits import EPHEMERAL_PORT_LOW_DEFAULT, FREE_PORT_MIN, PORT_MAX


def port_offset(dp_rank: int, tp_rank: int, tp_size: int) -> int:
    """Offset of rank `(dp_rank, tp_rank)` from an engine's base port."""
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} outside 0..{tp_size - 1}")
    if dp_rank < 0:
        raise ValueError(f"dp_rank must be >= 0, got {dp_rank}")
    return dp_rank * tp_size + tp_rank


def rank_port(base: int, dp_rank: int, tp_rank: int, tp_size: int) -> int:
    """The port rank `(dp_rank, tp_rank)` listens on and its peers dial."""
    port = base + port_offset(dp_rank, tp_rank, tp_size)
    if not 0 < port <= PORT_MAX:
        raise ValueError(f"port {port} (base {base}, dp {dp_rank}, tp {tp_rank}) is not a valid port")
    return port


def engine_ports(base: int, dp_size: int, tp_size: int) -> list[int]:
    """Every port an engine's ranks listen on: `dp_size * tp_size` consecutive ports."""
    return [rank_port(base, dp, tp, tp_size) for dp in range(dp_size) for tp in range(tp_size)]


def _check_ratio(consumer_tp_size: int, producer_tp_size: int) -> None:
    big, small = max(consumer_tp_size, producer_tp_size), min(consumer_tp_size, producer_tp_size)
    if small < 1 or big % small:
        raise ValueError(
            f"consumer tp {consumer_tp_size} and producer tp {producer_tp_size}: one must divide the other"
        )


def holder_ranks(consumer_tp_rank: int, consumer_tp_size: int, producer_tp_size: int) -> list[int]:
    """The producer TP ranks whose KV consumer rank `consumer_tp_rank` reads (and must release).

    A larger consumer TP splits a producer rank's heads over several consumer
    ranks; a smaller one gathers several producer ranks into one consumer rank.
    """
    _check_ratio(consumer_tp_size, producer_tp_size)
    if consumer_tp_size >= producer_tp_size:
        return [consumer_tp_rank // (consumer_tp_size // producer_tp_size)]
    per = producer_tp_size // consumer_tp_size
    return list(range(consumer_tp_rank * per, (consumer_tp_rank + 1) * per))


def releases_expected(consumer_tp_size: int, producer_tp_size: int) -> int:
    """How many consumer ranks release each producer rank (the producer map's `acks_expected`)."""
    _check_ratio(consumer_tp_size, producer_tp_size)
    return max(1, consumer_tp_size // producer_tp_size)


def consumer_ranks_of(producer_tp_rank: int, producer_tp_size: int, consumer_tp_size: int) -> list[int]:
    """The consumer TP ranks that read from (or are written by) producer rank `producer_tp_rank`."""
    _check_ratio(consumer_tp_size, producer_tp_size)
    return [
        c for c in range(consumer_tp_size) if producer_tp_rank in holder_ranks(c, consumer_tp_size, producer_tp_size)
    ]


def free_loopback_ports(count: int) -> list[int]:
    """Distinct free ports on 127.0.0.1, for tests and the simulator.

    Drawn at random below the kernel's ephemeral range (`ip_local_port_range`), from
    `FREE_PORT_MIN` up: the kernel never hands those out for `bind(0)` or an outgoing
    connection, so the many sockets a vLLM engine opens while it starts cannot take one
    between our choosing and the engine binding it. Another program choosing the same
    way still could, so callers that bind them retry on a clash.
    """
    ephemeral_low = _ephemeral_low()
    candidates = list(range(FREE_PORT_MIN, ephemeral_low))
    random.SystemRandom().shuffle(candidates)
    ports: list[int] = []
    for port in candidates:
        if len(ports) == count:
            return ports
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
    if len(ports) == count:
        return ports
    raise OSError(f"no {count} free ports on 127.0.0.1 between {FREE_PORT_MIN} and {ephemeral_low}")


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return EPHEMERAL_PORT_LOW_DEFAULT
