"""Builds a scheduler half or a worker half from a config: ledger, channel and transport at the right ports."""

from __future__ import annotations

from typing import Any

import zmq

from kvledger.connector.channel import Channel
from kvledger.connector.config import ConnectorConfig
from kvledger.connector.generation import draw_generation
from kvledger.connector.scheduler import SchedulerCore
from kvledger.connector.store import open_ledger
from kvledger.connector.transports import make_transport
from kvledger.connector.worker import WorkerCore


def build_scheduler(config: ConnectorConfig) -> SchedulerCore:
    return SchedulerCore(config, open_ledger(config, config.source(scheduler=True)))


def build_worker(config: ConnectorConfig, *, context: zmq.Context[Any] | None = None) -> WorkerCore:
    """A worker core with its own ZMQ context (one per connector, closed by `close`) unless given one, and a
    generation drawn for this life of the rank (its channel and tcp transport say it to peers)."""
    generation = draw_generation()
    channel = Channel(
        config.host,
        config.my_port(config.handshake_port),
        config.my_port(config.notify_port),
        config.may_dial,
        context=context,
        key=config.control_key,
        may_receive_from=config.may_receive_from,
        next_key=config.control_key_next,
        generation=generation,
    )
    try:
        # A tcp request lives no longer than its transfer (a silent peer's requests free their slots then).
        tcp = {"request_timeout_s": config.transfer_timeout_s, "generation": generation}
        options = tcp if config.backend == "tcp" else {}
        transport = make_transport(config.backend, config.host, config.my_port(config.transport_port), **options)
    except BaseException:
        channel.close()
        raise
    return WorkerCore(config, open_ledger(config, config.source(scheduler=False)), transport, channel)
