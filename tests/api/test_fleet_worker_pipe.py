"""The service's side of a partition worker's pipe (`kvledger.api.fleet._Worker`): asks are sent by a thread of
their own, so a worker that reads nothing (stopped, or busy folding) fills its pipe without ever blocking the
service's event loop, which goes on serving the published audit; the asks fail once the worker's end is gone."""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import threading
from typing import Any

import msgspec
import pytest

from kvledger.api.fleet import WorkerLost, _Worker

ASKS = 3_000
ID_CHARS = 1_000
"""3 MB of asks: far more than a socket pair's buffers hold (a few hundred KB)."""


class _Ids:
    """The one thing `_Worker.ask` reads of its `Fleet`: the next request id."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)

    def next_id(self) -> int:
        return next(self._ids)


def test_asks_of_a_worker_that_reads_nothing_never_block_the_event_loop() -> None:
    ours, theirs = multiprocessing.Pipe(duplex=True)  # `theirs`, the worker's end, is never read
    outcome: dict[str, Any] = {}

    async def main() -> None:
        worker = _Worker(_Ids(), [0])  # type: ignore[arg-type]
        worker.connect(ours, asyncio.get_running_loop())
        worker.ready.set()
        asks = [asyncio.create_task(worker.ask("transfer", "x" * ID_CHARS)) for _ in range(ASKS)]
        spins = 0
        for _ in range(200):  # the loop goes on while every ask waits on the full pipe
            await asyncio.sleep(0)
            spins += 1
        outcome["spins"] = spins
        outcome["pending"] = sum(not a.done() for a in asks)
        theirs.close()  # the worker's end gone: the sender's blocked send fails, and so does every ask
        results = await asyncio.gather(*asks, return_exceptions=True)
        outcome["lost"] = sum(isinstance(r, WorkerLost) for r in results)

    runner = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    runner.start()
    runner.join(timeout=120)  # a liveness bound, not a timing: a blocked loop never gets here at all
    if runner.is_alive():
        pytest.fail("the event loop blocked on a worker's full pipe")
    assert outcome == {"spins": 200, "pending": ASKS, "lost": ASKS}


def test_an_ask_given_up_is_forgotten_and_its_late_reply_passed_over() -> None:
    """A probe that times out (`/readyz`) or a client that leaves gives up its ask: the service keeps nothing
    for it however many are given up while a worker is stopped, and the reply that comes later finds no one."""
    ours, theirs = multiprocessing.Pipe(duplex=True)

    async def main() -> tuple[int, int, bool]:
        worker = _Worker(_Ids(), [0])  # type: ignore[arg-type]
        worker.connect(ours, asyncio.get_running_loop())
        worker.ready.set()
        for _ in range(5):
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0):
                    await worker.ask("status")
        given_up = len(worker.waiting)
        rid = msgspec.msgpack.decode(theirs.recv_bytes())[1]  # the first ask, read at last by the worker
        answered = asyncio.create_task(worker.ask("status"))
        await asyncio.sleep(0)
        theirs.send_bytes(msgspec.msgpack.encode(["status", rid, b"late"]))
        for _ in range(4):
            theirs.recv_bytes()
        newest = msgspec.msgpack.decode(theirs.recv_bytes())[1]
        theirs.send_bytes(msgspec.msgpack.encode(["status", newest, b"now"]))
        reply = await asyncio.wait_for(answered, 60)  # a liveness bound, never reached unless the test failed
        theirs.close()  # the reader sees the end and says so while the loop still runs
        async with asyncio.timeout(60):
            while worker.ready.is_set():
                await asyncio.sleep(0.01)
        return given_up, len(worker.waiting), reply == b"now"

    assert asyncio.run(main()) == (0, 0, True)
