"""Waiting on an asyncio event with a timeout, without ever losing a cancellation.

`asyncio.wait_for` on Python 3.11 returns the inner result and drops a cancellation that arrives in the same
loop turn as the event it waits on (CPython gh-86296, fixed in 3.12): a background task cancelled at the
service's shutdown then went on waiting, and the shutdown waited on it for ever. `asyncio.timeout` keeps
the cancellation.
"""

from __future__ import annotations

import asyncio


async def wait_set(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait until `event` is set or `timeout_s` seconds pass; True if it was set. A cancellation is raised."""
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        return False
    return True
