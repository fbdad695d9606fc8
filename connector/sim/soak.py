"""The soak: the storm's engines, wire and faults over hours of simulated time, with the faults of long runs.

Time. A round is the storm's (`step_s`, vLLM's call order within it), stepped while any connector has
work that only steps move on (`SimEngine.connector_busy`: a live or never-mapped side, a notification on
the wire or unread) or a request waits to be placed. Once nothing does, the clock jumps to just before the
next timer (a burst of arrivals, a follow-up reuse, a preemption, a re-ask, a decode finishing, an engine
dying or restarting) and steps one idle round there first. vLLM would have stepped a decoding engine in
between; in such a step the connector only runs its maintenance, and the idle round runs it at least as
late as the last real step would have (so the ledgers have forgotten at least as much when the timer's
request comes: never kinder to the ledger's memory than the real engine).

Requests. Bursts of 1 to `burst_requests_max` requests arrive `burst_gap_min_s` to `burst_gap_max_s`
apart until `sim_hours`. A consumer request lives as in vLLM: scheduled (get_num_new_matched_tokens with
its current params, allocation, update_state_after_alloc), waiting for its KV, scheduled again once it
arrived (update_state_after_alloc with 0 tokens), decoding, maybe preempted (blocks freed,
num_computed_tokens 0) and asked again seconds to minutes later, or, after a failed load, asked again at
once (kv_load_failure_policy "recompute"), and finally finished (request_finished, blocks freed).

Faults beyond the storm's: `preempt_reask`, `recompute`, `id_reuse` (a follow-up request seconds later
with the same transfer id, or a burst request carrying one used minutes or hours before), `restart` (the
engines take turns dying, `restart_gap_*` apart, and come back after `downtime_*` with their ledgers
reopened from `ledger_url`). What the driver knows for certain (which engine accepted which transfer id)
is the reference the connector's answers are checked against.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left, bisect_right
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal, TypeAlias

from kvledger.connector.config import ConnectorConfig
from kvledger.connector.sim.driver import Storm
from kvledger.connector.sim.engine import SimEngine
from kvledger.connector.sim.faults import NO_FAULTS
from kvledger.connector.sim.limits import (
    DEATH_IN_BURST_MAX_S,
    DEATH_IN_BURST_MIN_S,
    PREEMPT_AFTER_MIN_S,
    REUSE_HOURS_MIN_S,
    REUSE_IN_FLIGHT_SHARE,
    REUSE_MINUTES_MAX_S,
    REUSE_MINUTES_MIN_S,
    REUSE_SOON_MAX_S,
    REUSE_SOON_MIN_S,
    SOAK_ROUNDS_MAX,
)
from kvledger.connector.sim.requests import SimRequest
from kvledger.connector.sim.soak_config import SoakConfig, log_uniform
from kvledger.connector.sim.tally import Tally
from kvledger.ledger.events import Role, TransferId

ConsumerState: TypeAlias = Literal["new", "loading", "loaded", "running", "preempted", "recompute", "done"]
TimerKind: TypeAlias = Literal["arrival", "preempt", "reask", "finish", "engine"]
BURST = -1
"""An arrival timer's payload for a burst (any other payload is the number of a request to reuse)."""


@dataclass
class SoakRequest(SimRequest):
    issue_ts: float = 0.0
    state: ConsumerState = "new"
    """The consumer request's state in vLLM's scheduler."""
    loads: int = 0
    """Remote loads started (get_num_new_matched_tokens said async): at most one."""
    preemptions: int = 0
    reask: str = ""
    """Why the consumer request is asked again next: "reask" (preempted) or "recompute" (failed load)."""


@dataclass
class SoakTally(Tally):
    stepped_seconds: float = 0.0
    jumps: int = 0
    bursts: int = 0
    reasks: int = 0
    recomputes: int = 0
    local_computes: int = 0
    loaded_twice: list[str] = field(default_factory=list)
    reask_loads: list[str] = field(default_factory=list)
    second_alloc_claims: list[str] = field(default_factory=list)
    consumer_finish_kept: list[str] = field(default_factory=list)
    id_reuses: int = 0
    refused: Counter[str] = field(default_factory=Counter)
    answers: Counter[str] = field(default_factory=Counter)
    across_restart: int = 0
    wrongly_accepted: list[str] = field(default_factory=list)
    unmapped_refused: list[str] = field(default_factory=list)
    restarts: Counter[str] = field(default_factory=Counter)
    evicted_before_restart: Counter[str] = field(default_factory=Counter)
    peak_total: int = 0
    peak_per_ledger: dict[str, int] = field(default_factory=dict)
    refold_max: int = 0


class Timers:
    """Future events by kind, each a heap of (time, order, payload): the driver pops what is due."""

    def __init__(self) -> None:
        self._heaps: dict[TimerKind, list[tuple[float, int, object]]] = {}
        self._order = 0

    def push(self, kind: TimerKind, at: float, payload: object) -> None:
        self._order += 1
        heapq.heappush(self._heaps.setdefault(kind, []), (at, self._order, payload))

    def due(self, kind: TimerKind, now: float) -> list[object]:
        heap = self._heaps.get(kind)
        out: list[object] = []
        while heap and heap[0][0] <= now:
            out.append(heapq.heappop(heap)[2])
        return out

    def numbers(self, kind: TimerKind, now: float) -> list[int]:
        """Due payloads of a kind whose payload is a request number."""
        out = self.due(kind, now)
        assert all(isinstance(number, int) for number in out)
        return out  # type: ignore[return-value]

    def next_at(self) -> float | None:
        tops = [heap[0][0] for heap in self._heaps.values() if heap]
        return min(tops) if tops else None


class Soak(Storm):
    request_type = SoakRequest
    config: SoakConfig
    tally: SoakTally
    requests: list[SoakRequest]  # type: ignore[assignment]
    unresolved: dict[int, SoakRequest]  # type: ignore[assignment]

    def __init__(self, config: SoakConfig) -> None:
        if "restart" in config.soak_faults and config.ledger_url is None:
            raise ValueError("a soak with restarts needs a ledger_url to reopen the ledgers from")
        self.now = config.start_ts
        self.timers = Timers()
        super().__init__(config)
        self.ever_mapped: dict[Role, dict[TransferId, float]] = {"producer": {}, "consumer": {}}
        """Per engine: every transfer id it accepted, and when it first did (the driver's own record)."""
        self.restarted_at: dict[Role, float] = {"producer": -math.inf, "consumer": -math.inf}
        self._fresh_ts: list[float] = []
        self._fresh_numbers: list[int] = []
        self._next_death: tuple[float, Role] | None = None
        self._follow_ups: list[int] = []
        """Requests whose transfer id the proxy sends again once their transfer is over."""
        self.timers.push("arrival", config.start_ts, BURST)
        if "restart" in config.soak_faults:
            first: Role = self.rng.choice(("producer", "consumer"))
            self._plan_death(config.start_ts, first)

    # -- engines ------------------------------------------------------------------------

    def _new_tally(self) -> Tally:
        return SoakTally()

    def _clock(self) -> float:
        return self.now

    def _engine(
        self, config: ConnectorConfig, previous: SimEngine | None = None, *, new_layout: bool = False
    ) -> SimEngine:
        return SimEngine(
            config,
            self.config,
            self.network,
            clock=self._clock,
            previous=previous,
            tombstones_max=self.config.tombstones_max,
            new_layout=new_layout,
        )

    def _role_engine(self, role: Role) -> SimEngine:
        return self.producer if role == "producer" else self.consumer

    def _plan_death(self, now: float, role: Role) -> None:
        """The next death: `role`'s engine dies during the first burst after a restart gap, with transfers
        in flight (the soak is mostly idle time, where a death would find nothing to lose)."""
        cfg = self.config
        self._next_death = (now + self.rng.uniform(cfg.restart_gap_min_s, cfg.restart_gap_max_s), role)

    def _engine_timers(self, round_number: int, now: float) -> None:
        """At a round's start (the last round's wire settled): engines die and come back."""
        cfg = self.config
        for payload in self.timers.due("engine", now):
            assert isinstance(payload, tuple)
            action: str = payload[0]
            role: Role = payload[1]
            engine = self._role_engine(role)
            if action == "die":
                for ledger in engine.ledgers:
                    self.tally.evicted_before_restart[ledger.source] += ledger.state.tombstones_evicted
                self._kill(engine)
                self.timers.push("engine", now + self.rng.uniform(cfg.downtime_min_s, cfg.downtime_max_s), ("up", role))
            else:
                self._come_back(role, round_number, now)
                self._plan_death(now, "consumer" if role == "producer" else "producer")

    def _come_back(self, role: Role, round_number: int, now: float) -> None:
        """A new process on the same config and ports (`Storm._revive`): fresh KV and pool, vLLM knows no
        request, a new generation, the ledgers reopened from the store (the previous incarnation flushed them
        when it died)."""
        new = self._revive(self._role_engine(role), round_number)
        self.tally.restarts[role] += 1
        self.restarted_at[role] = now
        self.tally.refold_max = max(self.tally.refold_max, sum(new.tracked_sides().values()))
        self._measure()

    def _measure(self) -> None:
        tally, peaks, total = self.tally, self.tally.peak_per_ledger, 0
        for engine in self.engines:
            if engine.alive:
                for source, sides in engine.tracked_sides().items():
                    total += sides
                    if sides > peaks.get(source, 0):
                        peaks[source] = sides
        tally.peak_total = max(tally.peak_total, total)

    # -- the loop ----------------------------------------------------------------------

    def _loop(self) -> None:
        cfg, tally = self.config, self.tally
        base, k = cfg.start_ts, 0
        busy_since: float | None = None
        for round_number in range(SOAK_ROUNDS_MAX):
            now = base + k * cfg.step_s
            self.now = now
            tally.rounds, tally.final_now = round_number + 1, now
            self._round(round_number, now)
            self._measure()
            tally.stepped_seconds += cfg.step_s
            k += 1
            if self._busy():
                if busy_since is None:
                    busy_since = now
                elif now - busy_since > cfg.busy_max_s:
                    tally.horizon_reached = True  # busy with no pause for longer than bursts are apart: stuck
                    return
                continue
            busy_since = None
            at = self.timers.next_at()
            if at is None:
                return
            if at - cfg.step_s > base + k * cfg.step_s:
                base, k = at - cfg.step_s, 0  # one idle round just before the timer, then the timer's round
                tally.jumps += 1
        tally.horizon_reached = True

    def _round(self, round_number: int, now: float) -> None:
        self._engine_timers(round_number, now)
        super()._round(round_number, now)
        if self._follow_ups:
            self._arm_follow_ups(now)

    def _maybe_die(self) -> None:
        return  # deaths come from timers, at a round's start

    def _busy(self) -> bool:
        if any(engine.alive and engine.connector_busy() for engine in self.engines):
            return True
        for request in self.unresolved.values():
            producer, consumer = request.producer, request.consumer
            if (producer.needed and not producer.admitted) or (consumer.needed and not consumer.admitted):
                return True
            if request.state == "loaded" and not consumer.lost:
                return True  # scheduled again next step
        return False

    # -- arrivals --------------------------------------------------------------------------

    def _arrivals(self, round_number: int, now: float) -> None:
        for payload in self.timers.numbers("arrival", now):
            if payload == BURST:
                self._burst(round_number, now)
            else:
                self._issue_reuse(self.requests[payload], round_number, now)

    def _burst(self, round_number: int, now: float) -> None:
        cfg, rng = self.config, self.rng
        self.tally.bursts += 1
        reuse = "id_reuse" in cfg.soak_faults
        for _ in range(rng.randint(1, cfg.burst_requests_max)):
            old = self._old_request(now) if reuse and rng.random() < cfg.reuse_rate else None
            if old is not None:
                self._issue_reuse(old, round_number, now)
            else:
                self._issue_fresh(round_number, now)
        at = now + rng.uniform(cfg.burst_gap_min_s, cfg.burst_gap_max_s)
        if at < cfg.end_ts:
            self.timers.push("arrival", at, BURST)
        if self._next_death is not None and self._next_death[0] <= now:
            self.timers.push("engine", now + rng.uniform(DEATH_IN_BURST_MIN_S, DEATH_IN_BURST_MAX_S),
                             ("die", self._next_death[1]))  # fmt: skip
            self._next_death = None

    def _issue_fresh(self, round_number: int, now: float) -> None:
        cfg, tally = self.config, self.tally
        request = self._issue(tally.issued, round_number)
        tally.issued += 1
        assert isinstance(request, SoakRequest)
        request.issue_ts = now
        self._fresh_ts.append(now)
        self._fresh_numbers.append(request.number)
        if "id_reuse" in cfg.soak_faults and self.rng.random() < cfg.reuse_rate:
            self._follow_ups.append(request.number)

    def _arm_follow_ups(self, now: float) -> None:
        """A follow-up reuse arrives seconds after its first request: half of them while the first
        transfer may still be in flight (in WRITE mode only the prompt digest in remote_blocks then tells
        the two consumer requests apart), the others once it is over on both engines (decided, refused or
        lost), when its sides are still held whole or just compacted."""
        waiting = []
        for number in self._follow_ups:
            request = self.requests[number]
            if _transfer_over(request) or self.rng.random() < REUSE_IN_FLIGHT_SHARE:
                self.timers.push("arrival", now + self.rng.uniform(REUSE_SOON_MIN_S, REUSE_SOON_MAX_S), number)
            else:
                waiting.append(number)
        self._follow_ups = waiting

    def _issue_reuse(self, old: SoakRequest, round_number: int, now: float) -> None:
        tally = self.tally
        request = self._new_request(tally.issued, round_number, old.transfer_id, NO_FAULTS, reuse_of=old.number)
        tally.issued += 1
        tally.id_reuses += 1
        assert isinstance(request, SoakRequest)
        request.issue_ts = now

    def _old_request(self, now: float) -> SoakRequest | None:
        """A fresh request issued minutes or hours ago (whichever the draw prefers and there is)."""
        times = self._fresh_ts
        minutes = (bisect_left(times, now - REUSE_MINUTES_MAX_S), bisect_right(times, now - REUSE_MINUTES_MIN_S))
        hours = (0, bisect_right(times, now - REUSE_HOURS_MIN_S))
        ranges = [minutes, hours] if self.rng.random() < 0.5 else [hours, minutes]
        for low, high in ranges:
            if high > low:
                return self.requests[self._fresh_numbers[self.rng.randrange(low, high)]]
        return None

    # -- the producer: what request_finished answered for a transfer id ---------------------

    def _request_finished(self, round_number: int, now: float) -> None:
        finishing = list(self._finishing)
        answers = {q.number: self._answer("producer", q.transfer_id) for q in finishing if q.reuse_of is not None}
        super()._request_finished(round_number, now)
        for request in finishing:
            self._judge("producer", request, refused=request.producer.finished, answer=answers.get(request.number))

    def _prefill_not_kept(self, request: SimRequest) -> None:
        """A refused transfer id: vLLM frees the prefill's blocks at once (the consumer gets no params)."""
        engine, side = self.producer, request.producer
        engine.pool.free(side.blocks, request.owner)
        engine.known.discard(side.request_id)
        side.finished = True
        self._check_resolved(request)

    def _answer(self, role: Role, tid: TransferId) -> str:
        """How the engine's scheduler ledger knows `tid` right now: a live side, a decided side held whole,
        a tombstone, the id memory past the tombstone bound, or not at all."""
        ledger = self._role_engine(role).scheduler.ledger
        state, key = ledger.state, (ledger.source, tid)
        if key in state.live:
            return "live"
        if key in state.transfers:
            return "whole"
        if state.side(key) is not None:
            return "tombstone"
        return "id_memory" if state.was_mapped(key) else "unknown"

    def _judge(self, role: Role, request: SimRequest, *, refused: bool, answer: str | None) -> None:
        """Check a side's answer to a transfer id against the driver's record of what that engine accepted."""
        tally, tid = self.tally, request.transfer_id
        accepted = self.ever_mapped[role]
        if refused and tid not in accepted:
            tally.unmapped_refused.append(f"{role}:{tid}:{request.number}")  # an id-memory false positive
        elif refused:
            tally.refused[role] += 1
            tally.answers[f"{role}:{answer}"] += 1
            if accepted[tid] < self.restarted_at[role]:
                tally.across_restart += 1
        elif tid in accepted:
            tally.wrongly_accepted.append(f"{role}:{tid}:{request.number}")
        if not refused:
            accepted.setdefault(tid, self.now)

    # -- the consumer: vLLM's scheduling of one request, from first ask to finish --------------

    def _consumer_admissions(self, round_number: int, now: float) -> None:
        for number in self.timers.numbers("preempt", now):
            self._preempt(self.requests[number], now)
        for request in list(self.unresolved.values()):
            if request.state == "loaded" and not request.consumer.lost:
                self._scheduled_after_load(request, now)
        for request in list(self.unresolved.values()):
            side = request.consumer
            if side.admitted or not side.needed or side.admit_round > round_number or not request.handed_over:
                continue
            self._ask(request, now)
        for number in self.timers.numbers("reask", now):
            request = self.requests[number]
            if not request.consumer.lost and request.state in ("preempted", "recompute"):
                self._ask(request, now)

    def _ask(self, request: SoakRequest, now: float) -> None:
        """vLLM schedules the request with nothing computed: its first time, or a re-ask."""
        tally, params = self.tally, request.consumer_params
        first = not request.consumer.admitted
        names_transfer = first and params is not None and params.do_remote_prefill
        reused = names_transfer and request.reuse_of is not None
        answer = self._answer("consumer", request.transfer_id) if reused else None
        loads = self._schedule_consumer(request, now)
        if not first:
            if request.reask == "recompute":
                tally.recomputes += 1
            else:
                tally.reasks += 1
            if loads:
                tally.reask_loads.append(f"{request.transfer_id}:{request.number}")
        if names_transfer:
            self._judge("consumer", request, refused=not loads, answer=answer)
        if loads:
            request.loads += 1
            if request.loads > 1:
                tally.loaded_twice.append(f"{request.transfer_id}:{request.number}")
            request.state = "loading"
        else:
            tally.local_computes += 1
            self._decode(request, now)

    def _loaded(self, request: SimRequest, now: float) -> None:
        assert isinstance(request, SoakRequest)
        request.state = "loaded"  # WAITING again with its tokens computed: scheduled in the next step

    def _scheduled_after_load(self, request: SoakRequest, now: float) -> None:
        """vLLM schedules the loaded request (num_computed_tokens > 0: no get_num_new_matched_tokens) and
        calls update_state_after_alloc a second time, with 0 external tokens."""
        side = request.consumer
        if self.consumer.scheduler.on_alloc(side.request_id, request.consumer_params, (), 0, now):
            self.tally.second_alloc_claims.append(f"{request.transfer_id}:{request.number}")
        self._decode(request, now)

    def _load_failed(self, request: SimRequest, now: float) -> None:
        assert isinstance(request, SoakRequest)
        if not self._recomputes_failed_loads():
            super()._load_failed(request, now)
            return
        # kv_load_failure_policy "recompute": no valid token, so vLLM frees the blocks, sets
        # num_computed_tokens to 0 and schedules the request again (next step).
        self.consumer.pool.free(request.consumer.blocks, request.owner)
        request.consumer.blocks = ()
        request.state, request.reask = "recompute", "recompute"
        self.timers.push("reask", now, request.number)

    def _recomputes_failed_loads(self) -> bool:
        return "recompute" in self.config.soak_faults

    def _decode(self, request: SoakRequest, now: float) -> None:
        cfg, rng = self.config, self.rng
        request.state = "running"
        decode_s = rng.uniform(cfg.decode_min_s, cfg.decode_max_s)
        preempt = (
            "preempt_reask" in cfg.soak_faults
            and request.preemptions < cfg.preemptions_max
            and rng.random() < cfg.preempt_rate
        )
        if preempt:
            self.timers.push("preempt", now + rng.uniform(PREEMPT_AFTER_MIN_S, max(PREEMPT_AFTER_MIN_S, decode_s)),
                             request.number)  # fmt: skip
        else:
            self.timers.push("finish", now + decode_s, request.number)

    def _preempt(self, request: SoakRequest, now: float) -> None:
        """vLLM preempts the running request: its blocks are freed and num_computed_tokens goes back to 0."""
        if request.consumer.lost or request.state != "running":
            return
        cfg = self.config
        self.consumer.pool.free(request.consumer.blocks, request.owner)
        request.consumer.blocks = ()
        request.preemptions += 1
        request.state, request.reask = "preempted", "reask"
        delay = log_uniform(cfg.reask_delay_min_s, cfg.reask_delay_max_s, self.rng.random())
        self.timers.push("reask", now + delay, request.number)

    def _consumer_finishes(self, now: float) -> None:
        for number in self.timers.numbers("finish", now):
            request = self.requests[number]
            side = request.consumer
            if side.lost or request.state != "running":
                continue
            keep, params = self.consumer.scheduler.on_request_finished(
                side.request_id, request.consumer_params, side.blocks, now
            )
            if keep or params is not None:
                self.tally.consumer_finish_kept.append(f"{request.transfer_id}:{request.number}")
            request.state = "done"
            self._consumer_done(request)


def _transfer_over(request: SoakRequest) -> bool:
    """Neither engine has the request's transfer in flight any more."""
    producer, consumer = request.producer, request.consumer
    producer_over = not producer.needed or producer.lost or producer.finished
    consumer_over = (
        not consumer.needed
        or consumer.lost
        or consumer.reported > 0
        or (consumer.admitted and request.state not in ("new", "loading"))
    )
    return producer_over and consumer_over
