"""Whether the page may be believed: what stops it from vouching for the ledger, said at the top.

A page that shows "no findings" over a store it cannot read, or far behind the store, or while remote
appenders' events are being refused, tells a lie by omission. Each check here is a reason the audit below
may be missing events; while any holds, the page shows no all-clear.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from starlette.concurrency import run_in_threadpool

from kvledger.api.limits import STORE_PROBE_TIMEOUT_S
from kvledger.api.live import Live
from kvledger.ledger.humanize import ago, duration, utc
from kvledger.ledger.store.base import StoreError


@dataclass(frozen=True)
class Problem:
    kind: str
    """`store`, `behind`, `quarantine` or `ingest`: a class name on the page, for people's eyes and tests alike."""
    text: str


def ingest_problems(failure: tuple[float, str] | None, now: float) -> list[Problem]:
    """The page's word on ingest (the one-process service's and the partition workers'): failing while the
    last POST /events stored nothing, `failure` saying when and why."""
    if failure is None:
        return []
    at, why = failure
    return [
        Problem(
            "ingest",
            f"Ingest is failing: the last POST /events, at {utc(at)} "
            f"({ago(at, now)}), stored nothing ({why}); remote engines' events may be missing.",
        )
    ]


class TrustChecks:
    """Runs the checks for each page; at most one store probe in flight (a hung store never piles them up)."""

    def __init__(self, live: Live) -> None:
        self.live = live
        self._probe: asyncio.Future[bool] | None = None
        self._probe_started = 0.0

    async def problems(self) -> list[Problem]:
        live, now = self.live, time.time()
        out: list[Problem] = []
        folded = f"the audit below covers only what was folded up to cursor {live.cursor:,}"
        if live.store is None or live.store_error is not None:
            out.append(Problem("store", f"The store cannot be read ({live.store_error}): {folded}."))
        else:
            try:
                unread = await self._unread(now)
            except StoreError as error:
                out.append(Problem("store", f"The store cannot be read ({type(error).__name__}: {error}): {folded}."))
                unread = False
            if unread is None:
                out.append(
                    Problem(
                        "store",
                        f"The store did not answer within {duration(STORE_PROBE_TIMEOUT_S)} "
                        f"(asked {ago(self._probe_started, now)}): {folded}.",
                    )
                )
            elif unread and now - live.caught_up_from > live.settings.behind_after_s:
                out.append(
                    Problem(
                        "behind",
                        f"The service is behind the store: the store holds events after "
                        f"cursor {live.cursor:,} that are not folded; it last caught up "
                        f"{ago(live.caught_up_from, now)}: {folded}.",
                    )
                )
        if live.quarantined:
            out.append(
                Problem(
                    "quarantine",
                    f"{live.quarantined:,} events were quarantined: the store refused them for their content, "
                    "so the audit below does not fold them (see /quarantine).",
                )
            )
        return out + ingest_problems(live.ingest_failure, now)

    async def _unread(self, now: float) -> bool | None:
        """Whether the store holds events after the fold's cursor; None if it did not answer in time
        (a `StoreError` if it answered with one)."""
        store = self.live.store
        if store is None:
            return None
        if self._probe is None or self._probe.done():
            cursor = self.live.cursor

            def probe() -> bool:
                return bool(store.tail(cursor, 1))

            self._probe_started = now
            self._probe = asyncio.ensure_future(run_in_threadpool(probe))
        try:
            return await asyncio.wait_for(asyncio.shield(self._probe), STORE_PROBE_TIMEOUT_S)
        except TimeoutError:
            return None
