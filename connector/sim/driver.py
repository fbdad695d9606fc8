"""The storm's round loop: admit requests, step both engines in vLLM's order, settle the wire, repeat.

Each round the simulated clock advances by `step_s`. Within a round: new
requests arrive (up to `concurrency` in flight); the producer prefills and
schedules; the producer engine steps, and within its step, as in vLLM, the
finished prefills call request_finished before update_connector_output; the
consumer takes its requests and steps (decodes that end call request_finished
at the same point of its step); then the round ends: held
notifications due are sent, and the driver waits (bounded) until every real
byte and message of the round has landed before admitting them for the next
round. All randomness comes from one `random.Random(seed)` drawn in the
driver's thread, and the wire is seen only at round boundaries, so a seed
reproduces the run's decisions; thread timing only decides how long a round
takes in real time.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections import Counter

import zmq

from kvledger.connector.config import ConnectorConfig
from kvledger.connector.messages import ReleaseBlocks, encode
from kvledger.connector.params import parse_params
from kvledger.connector.ports import free_loopback_ports
from kvledger.connector.sim.config import StormConfig, engine_config
from kvledger.connector.sim.engine import SimEngine, StepReport
from kvledger.connector.sim.errors import SimulationError
from kvledger.connector.sim.faults import (
    NO_FAULTS,
    DeathPlan,
    RestartPlan,
    TransferFaults,
    draw_death,
    draw_faults,
    draw_restart,
    horizon_s,
)
from kvledger.connector.sim.integrity import checksums, prefill
from kvledger.connector.sim.limits import (
    ARRIVALS_PER_ROUND_MAX,
    PORT_ATTEMPTS_MAX,
    PORTS_PER_ENGINE,
    PROXY_DELAY_ROUNDS_MAX,
    ROUNDS_MAX,
    SETTLE_POLL_S,
    SETTLE_TIMEOUT_S,
    TAIL_ROUNDS,
)
from kvledger.connector.sim.network import SimNetwork
from kvledger.connector.sim.requests import SideRecord, SimRequest
from kvledger.connector.sim.silent import SilentPeer
from kvledger.connector.sim.tally import Tally
from kvledger.ledger.events import ReqId, TransferId
from kvledger.ledger.ids import stamped_id

LOCAL_TRAFFIC_NUMBER_BASE = 1 << 40
"""Content numbers of the producer's local traffic: apart from every storm request's."""


class Storm:
    request_type: type[SimRequest] = SimRequest

    def __init__(self, config: StormConfig) -> None:
        self.config = config
        self.now = config.start_ts
        """The simulated clock: the round's time, which every hook is given and the engines' ledgers read."""
        self.rng = random.Random(config.seed)
        self.network = SimNetwork()
        self.silent: SilentPeer | None = SilentPeer() if "silent_peer" in config.faults else None
        """Where silent_peer transfers' transport requests go (never answered)."""
        if self.silent is not None:
            self.network.silent = self.silent.endpoint()
        try:
            self.producer, self.consumer = self._build_engines()
        except BaseException:
            if self.silent is not None:
                self.silent.close()
            raise
        self.inflight_leaked = 0
        """In-flight slots of live engines' tcp transports still held after the last round (`_await_inflight`)."""
        self.engines = (self.producer, self.consumer)
        self.retired: list[SimEngine] = []
        """Engines that died and were replaced by a restart (their pools still count double frees)."""
        self._sent_before: Counter[tuple[str, int]] = Counter()
        """Per listening address: messages sent to it before its current listener started (a restart's
        listener counts what it receives from zero)."""
        self.death: DeathPlan | None = draw_death(self.rng, config)
        self.restart: RestartPlan | None = draw_restart(self.rng, config)
        self._restarting: SimEngine | None = None
        """peer_restart_layout: the engine that died at the last round boundary, to come back at the next round."""
        self.requests: list[SimRequest] = []
        self.unresolved: dict[int, SimRequest] = {}
        self.by_request: dict[ReqId, SimRequest] = {}
        self.tally = self._new_tally()
        self.prompt_tokens = config.blocks_per_request * config.block_size
        self._finishing: list[SimRequest] = []
        self._last_issue_now = config.start_ts
        self._forged_to: Counter[tuple[str, int]] = Counter()
        """Forged messages sent to each address (the round waits for them to land, as for any other)."""

    def _new_tally(self) -> Tally:
        return Tally()

    def _engine(
        self, config: ConnectorConfig, previous: SimEngine | None = None, *, new_layout: bool = False
    ) -> SimEngine:
        """One engine's process on `config` (a restart passes the engine it replaces). Its ledgers read the
        simulated clock: a restart fails what the previous process held at the round's time, not the wall
        clock's, which runs apart from it (the failures would be stamped after the new life's events)."""
        return SimEngine(config, self.config, self.network, clock=self._clock, previous=previous, new_layout=new_layout)

    def _clock(self) -> float:
        return self.now

    def _build_engines(self) -> tuple[SimEngine, SimEngine]:
        """Both engines on free ports; another program may take a port between our choosing and binding it,
        so a bind that fails is retried on fresh ports (a bounded number of times)."""
        config = self.config
        for attempt in range(PORT_ATTEMPTS_MAX):
            ports = free_loopback_ports(2 * PORTS_PER_ENGINE)
            mine, theirs = ports[:PORTS_PER_ENGINE], ports[PORTS_PER_ENGINE:]
            try:
                producer = self._engine(engine_config(config, "producer", mine, theirs))
            except zmq.ZMQError:
                if attempt + 1 == PORT_ATTEMPTS_MAX:
                    raise
                continue
            try:
                return producer, self._engine(engine_config(config, "consumer", theirs, mine))
            except BaseException as error:
                producer.close()
                if not isinstance(error, zmq.ZMQError) or attempt + 1 == PORT_ATTEMPTS_MAX:
                    raise
        raise SimulationError("no free ports")  # unreachable: the last attempt re-raises

    # -- the loop -----------------------------------------------------------------

    def run(self) -> Tally:
        tally = self.tally
        started = time.perf_counter()
        try:
            self._loop()
            self._await_inflight()
            for engine in self.engines:
                if engine.alive:
                    for ledger in engine.ledgers:
                        ledger.take_releases()  # decided in the last step, not yet acted on: still decisions
        finally:
            for engine in self.engines:
                if engine.alive:
                    engine.close()
            if self.silent is not None:
                self.silent.close()
            tally.wall_seconds = time.perf_counter() - started
        return tally

    def _loop(self) -> None:
        cfg, tally = self.config, self.tally
        horizon = horizon_s(cfg)
        tail = TAIL_ROUNDS
        for round_number in range(ROUNDS_MAX):
            now = cfg.start_ts + round_number * cfg.step_s
            self.now = now
            tally.rounds, tally.final_now = round_number + 1, now
            self._round(round_number, now)
            if self._quiet():
                tail -= 1
                if tail == 0:
                    break
            elif now > self._last_issue_now + horizon:
                tally.horizon_reached = True  # what is unresolved now is hung: every deadline has passed
                break

    def _round(self, round_number: int, now: float) -> None:
        if self._restarting is not None:
            self._revive(self._restarting, round_number, new_layout=True)
            self._restarting = None
        self._arrivals(round_number, now)
        producer, consumer = self.producer, self.consumer
        if producer.alive:
            self._local_traffic(round_number)
            self._producer_admissions(round_number, now)
            report = producer.step(now, round_number, lambda _failed: self._request_finished(round_number, now))
            self._on_producer_report(report)
        if consumer.alive:
            self._consumer_admissions(round_number, now)
            report = consumer.step(now, round_number, lambda failed: self._consumer_stopped(failed, now))
            self._on_consumer_report(report, now)
        self._maybe_restart()
        self._maybe_die()
        self._settle(round_number + 1)

    def _quiet(self) -> bool:
        if self.unresolved or self.tally.issued < self._issuable():
            return False
        return not any(engine.alive and engine.connector_busy() for engine in self.engines)

    def _issuable(self) -> int:
        """Requests the proxy can still route: none once a READ producer is dead (nobody can prefill)."""
        if self.tally.dead == "prefill-0" and self.config.mode == "read":
            return self.tally.issued
        return self.config.requests

    # -- requests arrive --------------------------------------------------------------

    def _arrivals(self, round_number: int, now: float) -> None:
        cfg, tally = self.config, self.tally
        arrived = 0
        while (
            tally.issued < self._issuable()
            and len(self.unresolved) < cfg.concurrency
            and arrived < ARRIVALS_PER_ROUND_MAX
        ):
            self._issue(tally.issued, round_number)
            tally.issued += 1
            arrived += 1
            self._last_issue_now = now

    def _issue_now(self, round_number: int) -> float:
        """The proxy's clock when a request of round `round_number` arrives (the soak's jumps over idle time)."""
        return self.config.start_ts + round_number * self.config.step_s

    def _issue(self, number: int, round_number: int) -> SimRequest:
        # Stamped as kvledger's proxy stamps them (proxy/app.py), with the seed and the request's number as
        # the random bits: the same run issues the same ids, and no two requests of a run share one.
        tid = stamped_id(self._issue_now(round_number), ((self.config.seed % (1 << 42)) << 32) | number)
        return self._new_request(number, round_number, tid, draw_faults(self.rng, self.config))

    def _new_request(
        self, number: int, round_number: int, tid: TransferId, faults: TransferFaults, reuse_of: int | None = None
    ) -> SimRequest:
        """Request `number` arrives at the proxy carrying transfer id `tid`; each engine gets its side."""
        cfg = self.config
        lead = self.rng.randint(0, PROXY_DELAY_ROUNDS_MAX)
        producer = SideRecord(ReqId(f"p-{number}"), admit_round=round_number)
        consumer = SideRecord(ReqId(f"c-{number}"), admit_round=round_number)
        if cfg.mode == "read":
            consumer.admit_round += lead  # the proxy hands the prefill's answer to the decode engine
        else:
            producer.admit_round += lead  # the decode engine allocated first; the prefill runs a little later
        consumer.needed = not faults.never_ready and self.consumer.alive
        if faults.late_reader_rounds:
            consumer.admit_round = round_number + faults.late_reader_rounds  # a decode backlog: past the deadline
        producer.needed = self.producer.alive
        if not producer.needed and cfg.mode == "read":
            consumer.needed = False
        request = self.request_type(number, tid, faults, producer, consumer, reuse_of=reuse_of)
        if cfg.mode == "write":
            p = self.producer.config
            request.consumer_params = parse_params({
                "transfer_id": tid, "do_remote_prefill": True, "remote_host": p.host,
                "remote_handshake_port": p.handshake_port, "remote_notify_port": p.notify_port,
                "remote_engine_id": p.engine_id,
            })  # fmt: skip
            request.handed_over = True  # the decode engine allocates first and tells the prefill where to write
        self.network.issue(tid, None if faults is NO_FAULTS else faults)
        if self.tally.dead is not None:
            self.tally.death_touched.add(tid)
        self.requests.append(request)
        self.unresolved[number] = request
        self.by_request[producer.request_id] = request
        self.by_request[consumer.request_id] = request
        self._check_resolved(request)
        return request

    def _producer_admissions(self, round_number: int, now: float) -> None:
        cfg, engine = self.config, self.producer
        for request in list(self.unresolved.values()):
            side = request.producer
            if side.admitted or not side.needed or side.admit_round != round_number:
                continue
            raw: dict[str, object] = {"transfer_id": request.transfer_id, "do_remote_decode": True}
            if cfg.mode == "write":
                c = self.consumer.config
                raw.update(remote_host=c.host, remote_handshake_port=c.handshake_port,
                           remote_notify_port=c.notify_port, remote_engine_id=c.engine_id)  # fmt: skip
            request.producer_params = parse_params(raw)
            # vLLM's schedule() asks every new request, a prefill's too (the producer's answer: nothing to load).
            engine.scheduler.matched_tokens(request.producer_params, self.prompt_tokens, 0)
            blocks = engine.pool.allocate(cfg.blocks_held, request.owner)
            if blocks is None:
                raise SimulationError("producer KV pool exhausted: num_blocks is below what concurrency needs")
            side.blocks, side.admitted = blocks, True
            engine.known.add(side.request_id)
            request.checksums = prefill(engine.caches, blocks, cfg.seed, request.number, cfg.state_blocks)
            if cfg.mode == "write":
                engine.scheduler.on_save(
                    side.request_id,
                    request.producer_params,
                    blocks,
                    now,
                    prompt_digest=request.prompt_digest,
                    block_groups=cfg.block_groups,
                )
            if request.faults.lag_rounds:
                # READ maps at request_finished, whose metadata goes out with the next step.
                first = round_number + (1 if cfg.mode == "read" else 0)
                engine.lagged[request.transfer_id] = first + request.faults.lag_rounds
            self._finishing.append(request)

    def _local_traffic(self, round_number: int) -> None:
        """The prefill engine's other work (requests it serves itself): each round one of them writes its KV
        into the blocks on top of the free list and finishes. The pool is as it was (same blocks, same order),
        but a block freed too early now holds another request's KV, as in a busy engine, so a late read of it
        shows in the checksums even after the storm's own arrivals have ended."""
        cfg, pool = self.config, self.producer.pool
        owner = TransferId("local-traffic")
        blocks = pool.allocate(cfg.blocks_held, owner)
        if blocks is None:
            return
        prefill(self.producer.caches, blocks, cfg.seed, LOCAL_TRAFFIC_NUMBER_BASE + round_number, cfg.state_blocks)
        pool.free(blocks, owner)

    def _request_finished(self, round_number: int, now: float) -> None:
        """After the prefill's forward: max_tokens=1, so the request finishes in the same step."""
        engine = self.producer
        finishing, self._finishing = self._finishing, []
        for request in finishing:
            side = request.producer
            keep, kv = engine.scheduler.on_request_finished(
                side.request_id, request.producer_params, side.blocks, now, block_groups=self.config.block_groups
            )
            if self.config.mode == "read":
                request.consumer_params, request.handed_over = parse_params(kv), True
            if not keep:
                self._prefill_not_kept(request)
                continue
            if request.faults.forged_release:
                self._forge_release(request)
            due = round_number + 1
            if request.faults.lag_rounds:
                due = max(due, round_number + (1 if self.config.mode == "read" else 0) + request.faults.lag_rounds)
            engine.notify_finished(side.request_id, due)

    def _forge_release(self, request: SimRequest) -> None:
        """A `release` for the transfer from the loopback (allow-listed) without the key, to every producer
        rank's notify port: a premature release on demand, were it believed."""
        c = self.producer.config
        address = (c.host, c.my_port(c.notify_port))
        forged = ReleaseBlocks(transfer_id=request.transfer_id, rank=0, consumer_tp_size=1)
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        sock: zmq.Socket[bytes] = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, int(SETTLE_TIMEOUT_S * 1000))
        try:
            sock.connect(f"tcp://{address[0]}:{address[1]}")
            sock.send(encode(forged))
        finally:
            sock.close()
        self._forged_to[address] += 1
        self.tally.forged.add(request.transfer_id)
        self._await_forged(request.transfer_id)

    def _await_forged(self, transfer_id: TransferId) -> None:
        """Wait until the producer took the forged release: refused and recorded, or (no key: the negative
        control) in its inbox. Sent and left in flight, it reached the producer or, when the producer died
        later in the round, its next incarnation, as the machine's timing had it: a same-seed run then
        recorded one `drop` more or fewer."""
        channel = self.producer.channel
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while not (
            any(d.transfer_id == transfer_id for d in list(channel.dropped))
            or any(getattr(m, "transfer_id", None) == transfer_id for m in list(channel.inbox.queue))
        ):
            if time.monotonic() > deadline:
                raise SimulationError(f"the forged release of {transfer_id} did not reach the producer")
            time.sleep(SETTLE_POLL_S)

    def _prefill_not_kept(self, request: SimRequest) -> None:
        """request_finished told vLLM to free the prefill's blocks now (the storm never expects it)."""
        raise SimulationError(f"request_finished did not keep the blocks of {request.transfer_id}")

    def _consumer_admissions(self, round_number: int, now: float) -> None:
        for request in list(self.unresolved.values()):
            side = request.consumer
            if side.admitted or not side.needed or not request.handed_over:
                continue  # READ: until the prefill finished, the proxy has nothing to hand over
            if not side.arrived:
                # vLLM's add_request: the connector hears of it (on_new_request) and, while it waits, renews.
                side.arrived = True
                self.consumer._timed(
                    self.consumer.scheduler.on_new_request, side.request_id, request.consumer_params, now
                )
            if side.admit_round > round_number:
                continue
            if not self._schedule_consumer(request, now):
                raise SimulationError(f"consumer would not load {request.transfer_id}")

    def _schedule_consumer(self, request: SimRequest, now: float) -> bool:
        """vLLM schedules the consumer request with nothing computed (its first time, or a re-ask after a
        preemption or a failed load): get_num_new_matched_tokens with the request's current params, blocks
        allocated, then update_state_after_alloc. True when it loads remote KV (asynchronously)."""
        cfg, engine, side = self.config, self.consumer, request.consumer
        params = request.consumer_params
        count, is_async = engine.scheduler.matched_tokens(params, self.prompt_tokens, 0)
        blocks = engine.pool.allocate(cfg.blocks_held, request.owner)
        if blocks is None:
            raise SimulationError("consumer KV pool exhausted: num_blocks is below what concurrency needs")
        side.blocks, side.admitted = blocks, True
        engine.known.add(side.request_id)
        external = count if is_async else 0
        claimed = engine.scheduler.on_alloc(
            side.request_id,
            params,
            blocks if external > 0 else (),
            external,
            now,
            prompt_digest=request.prompt_digest,
            block_groups=cfg.block_groups if external > 0 else None,
        )
        if claimed and params is not None:
            request.consumer_params = params.taken()  # as vLLM's request keeps its updated params
        return is_async and count > 0

    # -- what vLLM's scheduler is told --------------------------------------------------

    def _on_producer_report(self, report: StepReport) -> None:
        engine = self.producer
        for request_id in sorted(report.outcome.finished_sending, key=_number):
            request = self._reported(engine, request_id)
            if request is not None and self._report(request.producer):
                engine.pool.free(request.producer.blocks, request.owner)
                engine.known.discard(request_id)
                request.producer.finished = True
                self._check_resolved(request)

    def _on_consumer_report(self, report: StepReport, now: float) -> None:
        outcome, tally, engine = report.outcome, self.tally, self.consumer
        invalid = outcome.invalid_block_ids | report.load_errors
        for request_id in sorted(outcome.finished_recving, key=_number):
            request = self._reported(engine, request_id)
            if request is None:
                continue
            side = request.consumer
            if not self._report(side):
                continue
            tid = request.transfer_id
            if request_id in outcome.failed_recving:
                side.failed = True
                if not set(side.blocks) <= invalid:
                    tally.load_errors_missing.append(tid)
                self._load_failed(request, now)
                continue
            if any(tid in e.transport.failed_terminally for e in self.engines):
                tally.failed_reported_as_received.append(tid)
            tally.integrity_checked += 1
            if checksums(engine.caches, side.blocks, self.config.state_blocks) != request.checksums:
                tally.integrity_failures.append(tid)
            self._loaded(request, now)

    def _consumer_stopped(self, failed: set[ReqId], now: float) -> None:
        """vLLM's update_from_output frees, before update_connector_output: the decodes that ended in this step,
        then, under kv_load_failure_policy "fail", every request still waiting for its KV that the workers'
        raw failed_recving names (vLLM ends it with an error; its blocks wait for finished_recving)."""
        self._consumer_finishes(now)
        if self._recomputes_failed_loads():
            return
        engine = self.consumer
        for request_id in sorted(failed, key=_number):
            request = self.by_request.get(request_id)
            if request is None or request_id not in engine.known:
                continue
            side = request.consumer
            if side.reported or side.finished or side.lost:
                continue  # no longer waiting for its KV: vLLM's `_handle_failed_recving` passes it by
            keep, params = engine.scheduler.on_request_finished(request_id, request.consumer_params, (), now)
            if keep or params is not None:
                raise SimulationError(f"request_finished of the failed load {request.transfer_id} kept blocks")

    def _recomputes_failed_loads(self) -> bool:
        """kv_load_failure_policy: the storm's is "fail" (a failed load ends the request)."""
        return False

    def _consumer_finishes(self, now: float) -> None:
        """Consumer requests that finish decoding in this step (the storm's end at their report)."""

    def _loaded(self, request: SimRequest, now: float) -> None:
        """The consumer's KV arrived (the storm's request then decodes at once and ends: its blocks go back)."""
        self._consumer_done(request)

    def _load_failed(self, request: SimRequest, now: float) -> None:
        """The consumer's load failed (kv_load_failure_policy "fail": the request ends with an error)."""
        self._consumer_done(request)

    def _consumer_done(self, request: SimRequest) -> None:
        """vLLM is done with the consumer request: its blocks go back to the pool."""
        side = request.consumer
        self.consumer.pool.free(side.blocks, request.owner)
        self.consumer.known.discard(side.request_id)
        side.finished = True
        self._check_resolved(request)

    def _reported(self, engine: SimEngine, request_id: ReqId) -> SimRequest | None:
        """The request a report names, if this engine's vLLM holds it. Else vLLM would fail its
        `assert req_id in self.requests`: a second report of a request it already let go is a double
        release, any other is recorded apart; either way the report goes no further."""
        request = self.by_request.get(request_id)
        if request_id in engine.known and request is not None:
            return request
        side = None if request is None else (request.producer if engine is self.producer else request.consumer)
        if side is not None and side.reported:
            self._report(side)
        else:
            self.tally.unknown_reports.append(f"{engine.name}:{request_id}")
        return None

    def _report(self, side: SideRecord) -> bool:
        """Count a finished report; False (and counted) when it is the second for this request."""
        side.reported += 1
        if side.reported > 1:
            self.tally.double_reports += 1
            return False
        return True

    def _check_resolved(self, request: SimRequest) -> None:
        if request.resolved:
            self.unresolved.pop(request.number, None)

    # -- the round boundary -------------------------------------------------------------

    def _maybe_restart(self) -> None:
        """peer_restart_layout: the engine dies at this round boundary (its transfers in flight are lost with it)
        and comes back at the start of the next round with another layout."""
        plan = self.restart
        if plan is None or self.tally.restarted or self.tally.dead is not None:
            return
        if self.tally.issued < plan.after_requests:
            return
        engine = self.producer if plan.role == "producer" else self.consumer
        self.tally.restarted.append(engine.name)
        self._kill(engine)
        self._restarting = engine

    def _revive(self, old: SimEngine, round_number: int, *, new_layout: bool = False) -> SimEngine:
        """A new process on the same ports: fresh KV and pool, vLLM knows no request, a new generation. With a
        store its ledgers reopen from it; without one it starts new logs, named apart (`<engine>.life<n>`) so
        that the merged log keeps one log per source."""
        config = old.config
        if self.config.ledger_url is None:
            config = dataclasses.replace(config, source_name=f"{config.engine_id}.life{old.incarnation + 1}")
        new = self._engine(config, previous=old, new_layout=new_layout)
        new.channel.round = round_number
        self.retired.append(old)
        if old is self.producer:
            self.producer = new
        else:
            self.consumer = new
        self.engines = (self.producer, self.consumer)
        self.network.revive(old.endpoints())
        self._sent_before[new.channel.address] = self._sent_to(new.channel.address)  # it counts from zero
        self.tally.dead = None
        return new

    def _maybe_die(self) -> None:
        death = self.death
        if death is None or self.tally.dead is not None or self.tally.issued < death.after_requests:
            return
        self._kill(self.producer if death.role == "producer" else self.consumer)

    def _kill(self, engine: SimEngine) -> None:
        """The engine's process dies: its requests in flight are lost with it; those it had not taken yet
        never reach it (and a READ consumer never gets a prefill that died)."""
        self.tally.dead = engine.name
        for request in list(self.unresolved.values()):
            self.tally.death_touched.add(request.transfer_id)
            side = request.producer if engine is self.producer else request.consumer
            if side.admitted and not side.finished:
                side.lost = True
            elif not side.admitted:
                side.needed = False
            if engine is self.producer and self.config.mode == "read" and not request.handed_over:
                request.consumer.needed = False  # the prefill never finished: nothing to hand the decode engine
            self._check_resolved(request)
        engine.kill()
        self.network.kill(engine.endpoints())

    def _sent_to(self, address: tuple[str, int]) -> int:
        """Messages every engine, past incarnations included, handed to ZMQ for `address`."""
        return sum(e.channel.sent_to[address] for e in (*self.engines, *self.retired)) + self._forged_to[address]

    def _peer_dead(self, peer: tuple[str, int]) -> bool:
        return self.network.is_dead(*peer)

    def _await_inflight(self) -> None:
        """After the last round every request was answered or given up (each transfer is decided); a given-up
        one's slot comes back at its transport's next sweep, in real time: wait for that (bounded by
        SETTLE_TIMEOUT_S), then count what live engines still hold. The negative control never gives a request
        up and sets no deadline: what it holds now it holds for good, so it is not waited for."""
        transports = [e.transport for e in self.engines if e.alive]
        deadline = time.monotonic() + (SETTLE_TIMEOUT_S if self.config.protections else 0.0)
        while any(t.inflight() for t in transports) and time.monotonic() < deadline:
            time.sleep(SETTLE_POLL_S)
        self.inflight_leaked = sum(t.inflight() for t in transports)

    def _settle(self, next_round: int) -> None:
        """End the round: send what is due, wait until every real byte and message landed, then show them."""
        alive = [e for e in self.engines if e.alive]
        if self.silent is not None:
            self.silent.drain()  # takes what reached it, answers nothing
        for engine in alive:
            engine.channel.release_due(next_round - 1)  # a message held d rounds is seen d rounds late
            engine.channel.round = next_round
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        for engine in alive:
            engine.transport.settle(deadline, time.monotonic)
        dead = self._peer_dead
        for engine in alive:
            # Handshakes with live peers finish within the round; one with a dead peer runs its timeout out
            # on its thread, and whatever it ends with reads as a failure (no answer reaches a dead process).
            if not engine.worker.linker.settle(deadline, dead):
                raise SimulationError(f"{engine.name}: handshakes with live peers did not finish")
            engine.worker.linker.admit(dead)
        for engine in alive:
            channel = engine.channel
            expected = self._sent_to(channel.address) - self._sent_before[channel.address]
            while channel.received() < expected:
                if time.monotonic() > deadline:
                    raise SimulationError(f"{engine.name}: {channel.received()} of {expected} notifications arrived")
                time.sleep(SETTLE_POLL_S)
        for engine in alive:
            engine.channel.admit()
            engine.transport.open()


def _number(request_id: ReqId) -> int:
    return int(request_id.split("-", 1)[1])
