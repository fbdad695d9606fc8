"""Transports behind one contract (base.py): tcp (pyzmq), mori (mori.io RDMA/XGMI), loopback (in-process)."""

from __future__ import annotations

from typing import Any

from kvledger.connector.transports.base import Transport


def make_transport(backend: str, host: str, port: int, **options: Any) -> Transport:
    """The transport named by the config's `backend`; imports it only when chosen."""
    if backend == "tcp":
        from kvledger.connector.transports.tcp import TcpTransport

        return TcpTransport(host, port, **options)
    if backend == "loopback":
        from kvledger.connector.transports.loopback import LoopbackTransport

        return LoopbackTransport(host)
    if backend == "mori":
        from kvledger.connector.transports.mori import MoriTransport

        return MoriTransport(host, port, **options)
    raise ValueError(f"unknown transport backend {backend!r}")
