"""Bytes made in a forked child: a large fold encoded while its owner goes on, the fold's lock held only for
the fork.

A fork copies nothing up front (copy-on-write): the child sees the fold as it was at the fork, encodes it,
writes the bytes to a pipe and exits; the parent reads them on a thread of its own (`ForkedChild.result`,
off the GIL while it waits). The service's snapshots (`kvledger.api.snapshots`) and a partition worker's
(`kvledger.ledger.fleet.run_worker`) are made so: encoding a million events' fold takes seconds, and a
request that waited on the fold's lock meanwhile would wait as long.

The child runs at a lower priority (`FORKED_CHILD_NICE`): its bytes are a save, due within seconds, while the
parent's folding and answering are what a reader waits on; on a machine whose cores are all busy the child
takes what they leave instead of a core for seconds at a time.

The child touches nothing the parent's other threads may hold (no store, lock, loop or logger): it makes
the bytes, writes them and leaves with `os._exit`, running no atexit hook or finalizer of the parent's.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import threading
import traceback
from collections.abc import Callable
from typing import NoReturn

FORKED_CHILD_NICE = 10
"""How much lower the child's scheduling priority is than its parent's (`os.nice`): on Linux a runnable nice-10
task gets about a tenth of the CPU time a nice-0 one does when they compete, and all of an idle core."""

_OK, _FAILED = b"\x00", b"\x01"
"""The first byte a child writes: the bytes follow, or the traceback of why there are none."""


class ChildFailed(RuntimeError):
    """The forked child exited without its bytes (the message says why: its traceback where it wrote one)."""


def fork_making(make: Callable[[], bytes]) -> ForkedChild:
    """Fork a child that writes `make()` to a pipe and exits; the caller holds whatever `make` must see
    unchanged (the fork is the only moment it needs it)."""
    read_fd, write_fd = os.pipe()
    try:
        pid = os.fork()
        if pid == 0:
            _run_child(make, write_fd)
    except BaseException:
        os.close(read_fd)  # no child (the fork failed): nothing will read it
        raise
    finally:
        os.close(write_fd)  # the parent's copy (the child never returns here)
    return ForkedChild(pid, read_fd)


def _run_child(make: Callable[[], bytes], write_fd: int) -> NoReturn:
    written = False
    try:
        signal.set_wakeup_fd(-1)  # an event loop's, in the parent: a signal here must not wake the parent
        for number in (signal.SIGINT, signal.SIGTERM):
            signal.signal(number, signal.SIG_DFL)
        gc.disable()  # a collection would walk (and copy) every page of the fold, and frees nothing here
        with contextlib.suppress(OSError):  # a platform without priorities encodes at the parent's
            os.nice(FORKED_CHILD_NICE)
        os.closerange(3, write_fd)  # none of the parent's sockets stays open for its peers through this child
        os.closerange(write_fd + 1, os.sysconf("SC_OPEN_MAX"))
        try:
            out = _OK + make()
        except BaseException:
            out = _FAILED + traceback.format_exc().encode()
        view = memoryview(out)
        while view:
            view = view[os.write(write_fd, view) :]
        written = out[:1] == _OK
    finally:
        os._exit(0 if written else 1)


class ForkedChild:
    """A child `fork_making` started: its pid and the read end of its pipe."""

    def __init__(self, pid: int, read_fd: int) -> None:
        self.pid, self.read_fd = pid, read_fd
        self._reaping = threading.Lock()
        self._reaped = False
        """Set once waited for: its pid may then be another process's, never to be signalled."""

    def result(self) -> tuple[bytes, float]:
        """(the bytes, CPU seconds the child took) once it exits; `ChildFailed` if it wrote none. Blocking:
        call it on a thread of its own."""
        chunks = []
        try:
            while chunk := os.read(self.read_fd, 1 << 20):
                chunks.append(chunk)
        finally:
            os.close(self.read_fd)
            with self._reaping:  # the pipe's end: the child has exited, or is exiting
                _, status, usage = os.wait4(self.pid, 0)
                self._reaped = True
        out = b"".join(chunks)
        if status != 0 or out[:1] != _OK:
            why = out[1:].decode(errors="replace").strip() if out[:1] == _FAILED else "it wrote nothing"
            raise ChildFailed(f"the forked child (pid {self.pid}) exited with status {status}: {why}")
        return out[1:], usage.ru_utime + usage.ru_stime

    def kill(self) -> None:
        """End the child now, unless it was already waited for (`result`, which then reaps it)."""
        with self._reaping:
            if not self._reaped:
                os.kill(self.pid, signal.SIGKILL)
