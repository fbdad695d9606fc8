"""`kvledger serve` as a process for the fleet tests: over partition workers (`--partitions`) or as one
process, with what those tests wait for (folded through a position, an audit published after a moment) and
read (JSON, every /transfers page, the fold's metrics); `one_fold_findings` and `first_seen`, what their
/audit and /transfers must say."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvledger.api.views import finding_out
from kvledger.connector.ports import free_loopback_ports
from kvledger.ledger.audit import audit
from kvledger.ledger.events import Drop, Event
from kvledger.ledger.fold import LedgerState
from kvledger.ledger.merge import batched
from kvledger.ledger.replay import replay_chunks

POLLS_MAX = 3_000
"""Polls (10 ms apart) for a service to answer and fold its store, and for its workers to exit."""
AUDIT_RESOLUTION_S = 0.1
"""The services' audit clock resolution: a published audit newer than a moment comes soon after it."""
FOLD_METRICS = (
    "kvledger_events", "kvledger_live_transfers", "kvledger_blocks_held", "kvledger_releases",
    "kvledger_forged_messages", "kvledger_leases", "kvledger_findings", "kvledger_live_transfers_by_phase",
    "kvledger_sources_lost", "kvledger_blocks_lost",
)  # fmt: skip
"""The metrics that derive from the fold: a service over partition workers says what one process says."""


def one_fold_findings(events: list[Event], now: float) -> list[dict[str, Any]]:
    """The findings at `now` of one fold of `events`, as /audit lists them (several codes, a double owner)."""
    findings = audit(replay_chunks(batched(events, 64)).state, now)
    assert any(f.code == "double_owner" for f in findings) and len({f.code for f in findings}) > 3
    return [json.loads(finding_out(f).model_dump_json()) for f in findings]


def first_seen(events: list[Event]) -> list[tuple[str, str]]:
    """Every transfer side one fold of `events` holds, in the order it first saw them, as /transfers lists them."""
    state = LedgerState()
    order: list[tuple[str, str]] = []
    seen: set[tuple[str, str]] = set()
    for e in events:
        state.apply(e)
        key = (e.source, e.transfer_id)
        if type(e) is not Drop and key in state.transfers and key not in seen:
            seen.add(key)
            order.append(key)
    return order


def get_json(base: str, path: str) -> Any:
    with urllib.request.urlopen(f"{base}{path}", timeout=30) as response:
        return json.loads(response.read())


class FleetService:
    def __init__(self, url: str, partitions: str | None, workers: int, log: Path, **env: str) -> None:
        """`kvledger serve` over `url`: with `partitions`, its partition workers (service name `test`); None,
        the one-process service; `env`, settings (`KVLEDGER_*`) of its own."""
        self.port = free_loopback_ports(1)[0]
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = log
        command = [sys.executable, "-m", "kvledger.cli", "serve", "--db", url, "--port", str(self.port)]
        if partitions is not None:
            command += ["--partitions", partitions, "--workers", str(workers), "--service", "test"]
        environment = os.environ | {"KVLEDGER_AUDIT_CACHE_RESOLUTION_S": str(AUDIT_RESOLUTION_S)} | env
        with log.open("w") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=environment)

    def _log_tail(self) -> str:
        return self.log.read_text()[-3000:]

    def get(self, path: str) -> Any:
        try:
            return get_json(self.base, path)
        except urllib.error.HTTPError as error:
            raise AssertionError(f"{path}: {error}; the service's log ends:\n{self._log_tail()}") from None

    def folded_through(self, position: int) -> dict[str, Any]:
        """Wait until the service answers and each of its partitions is complete through `position` (a store
        cursor, or a stream sequence); its /fleet/status then."""
        for _ in range(POLLS_MAX):
            assert self.process.poll() is None, self._log_tail()
            try:
                status: dict[str, Any] = get_json(self.base, "/fleet/status")  # refused until the service is up
            except urllib.error.HTTPError as error:
                assert error.code == 503, self._log_tail()  # a worker died as it was asked
                continue
            except OSError:
                time.sleep(0.01)
                continue
            if all(p["upto"] >= position for p in status["folded"].values()):
                return status
            time.sleep(0.01)
        raise AssertionError(f"the service on {self.port} did not fold through {position}:\n{self._log_tail()}")

    def published_after(self, moment: float) -> None:
        """Wait until the service's published audit (`GET /audit`) is at a clock past `moment`: computed after
        it, from what was folded by then."""
        for _ in range(POLLS_MAX):
            assert self.process.poll() is None, self._log_tail()
            try:
                if get_json(self.base, "/audit?limit=1")["now"] > moment:
                    return
            except OSError:
                pass  # not up yet
            time.sleep(0.01)
        raise AssertionError(f"the service on {self.port} published no audit after {moment}")

    def listed(self, page_size: int = 7) -> list[tuple[str, str]]:
        """Every transfer side `/transfers` lists, `page_size` a page, following next_cursor to the end."""
        listed: list[tuple[str, str]] = []
        cursor = 0
        while True:
            page = self.get(f"/transfers?limit={page_size}&cursor={cursor}")
            listed += [(t["source"], t["transfer_id"]) for t in page["transfers"]]
            if page["next_cursor"] is None:
                return listed
            cursor = page["next_cursor"]

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Its /metrics samples that derive from the fold, by (name, labels)."""
        with urllib.request.urlopen(f"{self.base}/metrics", timeout=30) as response:
            text = response.read().decode()
        return {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text)
            if family.name in FOLD_METRICS
            for sample in family.samples
            if not sample.name.endswith("_created")
        }

    def kill(self, workers: list[int]) -> None:
        """SIGKILL the service; its workers, their pipe gone, save their folds and exit: wait for them."""
        self.process.kill()
        self.process.wait(timeout=60)
        for _ in range(POLLS_MAX):
            if not any(_alive(pid) for pid in workers):
                return
            time.sleep(0.01)
        raise AssertionError(f"workers {workers} did not exit after the service was killed")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
        self.process.wait(timeout=60)


def _alive(pid: int) -> bool:
    """Not exited, nor a zombie (an orphan's exit is reaped by init, maybe not at once)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
