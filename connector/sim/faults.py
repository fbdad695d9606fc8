"""The fault plan: which faults each transfer gets, drawn from the run's one seeded RNG at admission."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Literal, TypeAlias

from kvledger.connector.sim.config import FaultKind, StormConfig
from kvledger.connector.sim.limits import (
    LAG_ROUNDS_MAX,
    LAG_ROUNDS_MIN,
    LATE_READER_PAST_DEADLINE_ROUNDS_MAX,
    LATE_READER_PAST_DEADLINE_ROUNDS_MIN,
    PROXY_DELAY_ROUNDS_MAX,
    REORDER_ROUNDS_MAX,
    SQ_FULL_BURST_OPS_MAX,
    SQ_FULL_ENDLESS_OPS,
)
from kvledger.ledger.events import Mode

MessageFaultKind: TypeAlias = Literal["drop", "duplicate", "reorder", "late"]
MESSAGE_FAULT_KINDS: tuple[MessageFaultKind, ...] = ("drop", "duplicate", "reorder", "late")

MESSAGE_TARGETS: dict[Mode, tuple[str, ...]] = {"read": ("release",), "write": ("remote_blocks", "write_done")}
"""The notification a message fault hits, by mode: READ's release; WRITE's remote_blocks or write_done."""

DEATH_AFTER_MIN_PERCENT = 70
DEATH_AFTER_MAX_PERCENT = 95
"""peer_death strikes once this share of the requests was issued: late enough that most traffic ran."""

RESTART_AFTER_MIN_PERCENT = 30
RESTART_AFTER_MAX_PERCENT = 60
"""peer_restart_layout strikes once this share of the requests was issued: transfers in flight with the old
life, and enough after it to move many with the new one (and before peer_death's earliest)."""

ENDLESS_BURST_FRACTION = 0.1
"""Of send-queue-full bursts, the share that outlasts transfer_timeout (the retries must then give up)."""


@dataclass(frozen=True)
class MessageFault:
    kind: MessageFaultKind
    target: str
    """The message type it hits (the first message of that type for the transfer)."""
    delay_rounds: int = 0


@dataclass(frozen=True)
class TransferFaults:
    """What goes wrong for one transfer. The default is nothing."""

    sq_full_ops: int = 0
    """The transfer's first this-many transport ops fail with send-queue-full (transient)."""
    terminal: bool = False
    """The op right after the burst fails terminally (a failed read or write)."""
    messages: tuple[MessageFault, ...] = ()
    lag_rounds: int = 0
    """The producer worker binds this transfer's metadata this many steps late (`early`)."""
    never_ready: bool = False
    forged_release: bool = False
    """A `release` without the control key reaches the producer when the prefill finishes."""
    late_reader_rounds: int = 0
    """The consumer request waits this many rounds (a decode backlog) before vLLM schedules it: past the
    producer's defer deadline."""
    silent: bool = False
    """The transfer's transport requests (READ: the consumer's reads; WRITE: the producer's writes) go to a peer
    that takes them and never answers (`SilentPeer`)."""

    def kinds(self) -> list[FaultKind]:
        out: list[FaultKind] = []
        if self.sq_full_ops:
            out.append("sq_full")
        if self.terminal:
            out.append("transfer_fail")
        out.extend(m.kind for m in self.messages)
        if self.lag_rounds:
            out.append("early")
        if self.never_ready:
            out.append("never_ready")
        if self.forged_release:
            out.append("forged_release")
        if self.late_reader_rounds:
            out.append("late_reader")
        if self.silent:
            out.append("silent_peer")
        return out


NO_FAULTS = TransferFaults()


def late_delay_rounds(config: StormConfig) -> int:
    """Rounds a `late` notification is held: past the consumer's deadline, the longest there is."""
    return math.ceil((config.recv_abort_timeout_s + config.transfer_timeout_s) / config.step_s)


def horizon_s(config: StormConfig) -> float:
    """Simulated seconds after a request's arrival by which every fault on it has played out (every deadline
    passed, every held notification sent): what is unresolved then is hung."""
    late_reader_s = 0.0
    if "late_reader" in config.faults:
        late_reader_s = (late_reader_base_rounds(config) + LATE_READER_PAST_DEADLINE_ROUNDS_MAX) * config.step_s
    return 2 * (config.recv_abort_timeout_s + config.transfer_timeout_s) + max(
        late_delay_rounds(config) * config.step_s, late_reader_s
    )


def late_reader_base_rounds(config: StormConfig) -> int:
    """Rounds from a request's arrival to its producer's defer deadline, at the latest (the proxy's delay
    included): a late reader waits this long plus its draw."""
    return math.ceil(config.defer_timeout_s / config.step_s) + PROXY_DELAY_ROUNDS_MAX + 1


def draw_faults(rng: random.Random, config: StormConfig) -> TransferFaults:
    """One transfer's faults. Draws happen in a fixed order for the enabled kinds only, so a seed and a
    config always give the same plan."""
    enabled, rate = config.faults, config.fault_rate

    def hit(kind: FaultKind) -> bool:
        return kind in enabled and rng.random() < rate

    sq_full_ops = 0
    if hit("sq_full"):
        endless = rng.random() < ENDLESS_BURST_FRACTION
        sq_full_ops = SQ_FULL_ENDLESS_OPS if endless else rng.randint(1, SQ_FULL_BURST_OPS_MAX)
    terminal = hit("transfer_fail")
    messages: list[MessageFault] = []
    targets = MESSAGE_TARGETS[config.mode]
    used: set[str] = set()
    for kind in MESSAGE_FAULT_KINDS:
        if not hit(kind):
            continue
        target = rng.choice(targets)
        if target in used:
            continue  # one fault per message type and transfer keeps each fault's effect attributable
        used.add(target)
        delay = 0
        if kind == "reorder":
            delay = rng.randint(1, REORDER_ROUNDS_MAX)
        elif kind == "late":
            delay = late_delay_rounds(config)
        messages.append(MessageFault(kind, target, delay))
    # Long enough that the consumer's release (READ: proxy delay, a read, a reply) or remote_blocks (WRITE)
    # reaches the producer worker before it binds the transfer.
    lag_rounds = rng.randint(LAG_ROUNDS_MIN, LAG_ROUNDS_MAX) if hit("early") else 0
    never_ready = hit("never_ready")
    forged_release = hit("forged_release")
    late_reader_rounds = 0
    if hit("late_reader") and not never_ready:
        late_reader_rounds = late_reader_base_rounds(config) + rng.randint(
            LATE_READER_PAST_DEADLINE_ROUNDS_MIN, LATE_READER_PAST_DEADLINE_ROUNDS_MAX
        )
    silent = hit("silent_peer")  # drawn last: the other kinds' draws stay as they were for a seed
    if silent:
        sq_full_ops, terminal = 0, False  # every op goes to the silent peer: none reaches a fault of the transport
    plan = TransferFaults(
        sq_full_ops, terminal, tuple(messages), lag_rounds, never_ready, forged_release, late_reader_rounds, silent
    )
    return NO_FAULTS if plan == NO_FAULTS else plan


@dataclass(frozen=True)
class DeathPlan:
    """peer_death: the engine that dies, after this many requests were issued."""

    role: Literal["producer", "consumer"]
    after_requests: int


def draw_death(rng: random.Random, config: StormConfig) -> DeathPlan | None:
    if "peer_death" not in config.faults:
        return None
    role: Literal["producer", "consumer"] = rng.choice(("producer", "consumer"))
    low = max(1, config.requests * DEATH_AFTER_MIN_PERCENT // 100)
    high = max(low, config.requests * DEATH_AFTER_MAX_PERCENT // 100)
    return DeathPlan(role, rng.randint(low, high))


@dataclass(frozen=True)
class RestartPlan:
    """peer_restart_layout: the engine that comes back with another layout, after this many requests were issued."""

    role: Literal["producer", "consumer"]
    after_requests: int


def draw_restart(rng: random.Random, config: StormConfig) -> RestartPlan | None:
    """The engine whose KV the other moves restarts (READ: the producer, read from; WRITE: the consumer, written
    to), before peer_death may strike, with traffic in flight and more to come."""
    if "peer_restart_layout" not in config.faults:
        return None
    low = max(1, config.requests * RESTART_AFTER_MIN_PERCENT // 100)
    high = max(low, config.requests * RESTART_AFTER_MAX_PERCENT // 100)
    return RestartPlan("producer" if config.mode == "read" else "consumer", rng.randint(low, high))
