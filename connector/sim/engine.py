"""One simulated engine: a scheduler core and one worker core, stepped in vLLM's order each round.

Real parts: the cores, the ZMQ channel and the tcp transport on loopback, KV
tensors on the CPU. Simulated parts: the clock (`now` comes from the driver),
the block pool, the forward pass (a prefill writes known bytes), and the faults
(wrapped channel and transport). Every event either ledger appends is collected
here through the log's listener, and every release a core acts on is recorded as
it takes it, so the run can be replayed and compared afterwards.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvledger.connector.config import ConnectorConfig
from kvledger.connector.metadata import SaveItem, SendItem, StepMetadata
from kvledger.connector.ports import engine_ports
from kvledger.connector.scheduler import SchedulerCore, WorkerOutcome
from kvledger.connector.sim.config import StormConfig
from kvledger.connector.sim.errors import SimulationError
from kvledger.connector.sim.faulty_channel import FaultyChannel
from kvledger.connector.sim.faulty_transport import FaultyTransport, tcp_limits
from kvledger.connector.sim.integrity import MAMBA_SUFFIX, block_stride_bytes, make_caches, sim_mamba_groups
from kvledger.connector.sim.network import SimNetwork
from kvledger.connector.sim.pool import BlockPool
from kvledger.connector.store import open_ledger
from kvledger.connector.transports.tcp import TcpTransport
from kvledger.connector.worker import WorkerCore
from kvledger.ledger.decisions import Release
from kvledger.ledger.events import Event, ReqId, TransferId
from kvledger.ledger.ledger import Ledger

T = TypeVar("T")


@dataclass
class StepReport:
    """What vLLM's scheduler learns from one step: the core's outcome plus the worker's load errors."""

    outcome: WorkerOutcome
    load_errors: set[int] = field(default_factory=set)


def sim_generation(storm: StormConfig, config: ConnectorConfig, incarnation: int) -> int:
    """An engine's generation (`connector/generation.py`), drawn from the run's seed, the engine and its
    incarnation so that a seed reproduces every message; 0 (none) in the negative control (`protections`)."""
    if not storm.protections:
        return 0
    return zlib.crc32(f"{storm.seed}/{config.engine_id}/{incarnation}".encode()) + 1


def _record(ledger: Ledger, events: list[Event], releases: list[Release]) -> None:
    """Collect every event appended and every release a core takes (live compaction may forget both).

    `events` holds what this source appended before (a restarted engine): the reopened store must continue
    right after it, so a restart that lost or invented an event fails here."""
    if ledger.log.next_seq != len(events) + 1:
        if not events:
            raise SimulationError(
                f"the store already holds events of {ledger.source}: give the simulator a fresh ledger_url"
            )
        raise SimulationError(
            f"{ledger.source} reopened at seq {ledger.log.next_seq}, but {len(events)} events were appended before"
        )
    ledger.log.subscribe(events.append)
    take = ledger.take_releases

    def take_and_record() -> list[Release]:
        out = take()
        releases.extend(out)
        return out

    ledger.take_releases = take_and_record  # type: ignore[method-assign]


class SimEngine:
    """One engine's process. A restart builds a new SimEngine on the same config and hands it the old one's
    `events` and `releases` (one list per source for the whole run); its ledgers reopen from `ledger_url`."""

    def __init__(
        self,
        config: ConnectorConfig,
        storm: StormConfig,
        network: SimNetwork,
        *,
        clock: Callable[[], float] = time.time,
        previous: SimEngine | None = None,
        tombstones_max: int | None = None,
        new_layout: bool = False,
    ) -> None:
        """`new_layout` (peer_restart_layout): this life's KV cache has another layout than the first's: twice the
        blocks, so every V run lies elsewhere (`integrity.make_caches`)."""
        self.config = config
        self.incarnation: int = previous.incarnation + 1 if previous is not None else 0
        """0 for the first process of this engine, then one more for each restart."""
        self.generation = sim_generation(storm, config, self.incarnation)
        self.name = config.engine_id
        self.alive = True
        self.known: set[ReqId] = set()
        """vLLM's own request table (`Scheduler.requests`): a report naming another request would fail vLLM's
        `assert req_id in self.requests`. A restarted engine starts with none."""
        self.load_before_forward = storm.start_load_before_forward
        num_blocks = 2 * storm.blocks if new_layout else storm.blocks
        self.pool = BlockPool(num_blocks)
        self.caches = make_caches(
            storm.layers,
            num_blocks,
            storm.block_size,
            storm.kv_heads,
            storm.head_dim,
            storm.mamba_layers,
        )
        self._strides = {name: block_stride_bytes(t) for name, t in self.caches.items()}
        self._saved_layers = [name for name in self.caches if not name.endswith(MAMBA_SUFFIX)]
        """The layers the forward saves: vLLM calls save_kv_layer for attention layers, never a Mamba mixer."""
        self.events: dict[str, list[Event]] = previous.events if previous else {}
        self.releases: dict[str, list[Release]] = previous.releases if previous else {}
        self.lagged: dict[TransferId, int] = {}
        """Transfers whose metadata this engine's worker binds late: transfer -> the round it binds."""
        self._held_send: list[tuple[int, SendItem]] = []
        self._held_save: list[tuple[int, SaveItem]] = []
        self._notices: list[tuple[int, ReqId]] = []
        self.hook_s_max = 0.0
        """The longest wall time one hook call took in this engine."""
        ledgers = []
        for scheduler in (True, False):
            ledger = open_ledger(config, config.source(scheduler=scheduler), clock=clock, tombstones_max=tombstones_max)
            ledgers.append(ledger)
            self.events.setdefault(ledger.source, [])
            self.releases.setdefault(ledger.source, [])
            try:
                _record(ledger, self.events[ledger.source], self.releases[ledger.source])
            except BaseException:
                for opened in ledgers:
                    opened.close()
                raise
        self.scheduler = SchedulerCore(config, ledgers[0])
        try:
            self.channel = FaultyChannel(
                config.host,
                config.my_port(config.handshake_port),
                config.my_port(config.notify_port),
                config.may_dial,
                network=network,
                key=config.control_key,
                may_receive_from=config.may_receive_from,
                next_key=config.control_key_next,
                generation=self.generation,
            )
        except BaseException:
            for ledger in ledgers:
                ledger.close()
            raise
        try:
            tcp = TcpTransport(
                config.host, config.my_port(config.transport_port), generation=self.generation, **tcp_limits(storm)
            )
        except BaseException:
            self.channel.close()
            for ledger in ledgers:
                ledger.close()
            raise
        self.transport = FaultyTransport(tcp, network, self._owner_at, forward_cancel=storm.protections)
        self.worker = WorkerCore(config, ledgers[1], self.transport, self.channel, gated_links=True)
        mamba = sim_mamba_groups(self.caches)
        groups = {layer: g.group for g in mamba for layer in g.layers}
        self.worker.register_kv_caches(self.caches, num_blocks, groups, mamba=mamba)
        # vLLM's EngineCore hands the workers' generations to the scheduler half once their caches are registered.
        self.scheduler.set_generations({config.tp_rank: self.generation})

    def _owner_at(self, layer: str, offset: int) -> TransferId | None:
        return self.pool.owner.get(offset // self._strides[layer])

    @property
    def ledgers(self) -> tuple[Ledger, Ledger]:
        return self.scheduler.ledger, self.worker.ledger

    def connector_busy(self) -> bool:
        """Whether the connector still has work that only steps move on: a live or never-mapped side (it has a
        deadline to reach), a notification held back or arrived but not yet read, a finished-request notice
        or lagged metadata still to hand over. An engine that is not busy does nothing in a step vLLM skips."""
        channel = self.channel
        if channel.held or channel.unread or self._notices or self.lagged or self._held_send or self._held_save:
            return True
        return any(ledger.state.live or ledger.state.unmapped for ledger in self.ledgers)

    def tracked_sides(self) -> dict[str, int]:
        """Per ledger: the transfer sides it holds in memory (live, decided and never-mapped sides held
        whole, plus tombstones): what its memory bound is about."""
        return {ledger.source: len(ledger.state.transfers) + ledger.state.tombstone_count for ledger in self.ledgers}

    def endpoints(self) -> list[tuple[str, int]]:
        """Every (host, port) this engine listens on."""
        c = self.config
        ports: list[int] = []
        for base in (c.handshake_port, c.notify_port, c.transport_port):
            ports.extend(engine_ports(base, c.dp_size, c.tp_size))
        return [(c.host, port) for port in ports]

    # -- vLLM's step ---------------------------------------------------------------

    def notify_finished(self, request_id: ReqId, round_number: int) -> None:
        """vLLM passes a finished request to the workers with the next step's output (or later, if lagged)."""
        self._notices.append((round_number, request_id))

    def _timed(self, hook: Callable[..., T], *args: Any) -> T:
        """Call one hook and keep the longest wall time any took (what a peer must never stretch)."""
        start = time.perf_counter()
        try:
            return hook(*args)
        finally:
            took = time.perf_counter() - start
            self.hook_s_max = max(self.hook_s_max, took)

    def step(self, now: float, round_number: int, stopped: Callable[[set[ReqId]], None]) -> StepReport:
        """One engine step, calling the connector's hooks in the order of vLLM's `Scheduler` (0.32 and 0.33
        alike; `hook_order.STEP_PHASES` is the same order as data, which the hook-order tests check against):

        1. `Scheduler.schedule`: per request it schedules, get_num_new_matched_tokens, then (blocks
           allocated) update_state_after_alloc; the driver's admissions make these calls before `step`.
           Then, last in schedule(), `_build_kv_connector_meta` -> build_connector_meta (the core's tick).
        2. The workers (`KVConnectorModelRunnerMixin._get_kv_connector_output` around the forward):
           bind_connector_metadata; start_load_kv before the forward only for synchronous loads, else right
           after launching it; per layer wait_for_layer_load / save_kv_layer (`kv_transfer_utils`); then
           wait_for_save, get_finished (get_transfer_results), and last get_block_ids_with_load_errors.
        3. `Scheduler.update_from_output`: it first reads the workers' raw failed_recving and invalid block
           ids (`_handle_failed_recving`, `_handle_invalid_blocks`: no connector call, and before the
           connector can rewrite them); then every request that stopped in this step's output is freed
           (`_free_request` -> `_connector_finished` -> request_finished / request_finished_all_groups),
           then the loads the workers' raw failed_recving names, under kv_load_failure_policy "fail"
           (error_req_ids -> `finish_requests` -> `_free_request`, the same request_finished); only then
           `_update_from_kv_xfer_finished` -> update_connector_output, followed by get_kv_connector_stats
           and take_events (which the simulator does not model). vLLM skips update_connector_output when
           the workers' output is empty, and so does this.

        `stopped` is the driver's part of step 3, given the workers' raw failed_recving: request_finished for
        the requests that stopped in this step (it runs whether or not the workers reported anything)."""
        timed = self._timed
        meta = self._lag(timed(self.scheduler.build_meta, now), round_number)
        worker = self.worker
        timed(worker.bind, meta, now)
        if self.load_before_forward:
            timed(worker.start_load, now)
        if meta.save:
            for name in self._saved_layers:  # the forward: one save per attention layer
                timed(worker.save_layer, name)
        if not self.load_before_forward:
            timed(worker.start_load, now)  # vLLM starts asynchronous loads after launching the forward
        timed(worker.wait_for_save, now)
        due = sorted(r for when, r in self._notices if when <= round_number)
        self._notices = [(when, r) for when, r in self._notices if when > round_number]
        sending, recving, failed = timed(worker.get_finished, due, now)
        load_errors = timed(worker.take_load_errors)
        stopped(failed)
        if not (sending or recving or failed or load_errors):
            return StepReport(WorkerOutcome(), load_errors)
        # Sorted: the core folds them in this order, and set order changes between processes.
        outcome = timed(self.scheduler.on_worker_output, sorted(sending), sorted(recving), sorted(failed), now)
        return StepReport(outcome, load_errors)

    def _lag(self, meta: StepMetadata, round_number: int) -> StepMetadata:
        """Hold lagged transfers' items back; hand over those due now (the `early` fault)."""
        if self.lagged:
            send, save = [], []
            for item in meta.send:
                due = self.lagged.pop(item.transfer_id, None)
                if due is None:
                    send.append(item)
                else:
                    self._held_send.append((due, item))
            for saved in meta.save:
                due = self.lagged.pop(saved.transfer_id, None)
                if due is None:
                    save.append(saved)
                else:
                    self._held_save.append((due, saved))
            meta.send, meta.save = send, save
        if self._held_send:
            meta.send.extend(item for due, item in self._held_send if due <= round_number)
            self._held_send = [(due, item) for due, item in self._held_send if due > round_number]
        if self._held_save:
            meta.save.extend(item for due, item in self._held_save if due <= round_number)
            self._held_save = [(due, item) for due, item in self._held_save if due > round_number]
        return meta

    # -- life and death -------------------------------------------------------------

    def kill(self) -> None:
        """The engine dies: its worker's channel and transport close, its scheduler stops being stepped."""
        self.alive = False
        self.channel.discard_held()
        self.close()

    def close(self) -> None:
        self.worker.close()  # channel, transport, and the worker's ledger (flushing any store)
        self.scheduler.ledger.close()
