"""A seeded generator of P/D ledger traffic (both sides), for benchmarks, tests and demos.

It writes the events a producer and a consumer would append, interleaved as
`concurrency` transfers run at once, with optional faults (transient send-queue
failures, terminal failures, lost releases that end in expire, duplicate and
early acks). Same seed, same events. It knows nothing of the fold: the fold's
decisions on its output are what tests check.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

import msgspec

from kvledger.ledger.events import Ack, Event, Expire, Fail, Map, Mode, ReqId, Schedule, Seal, TransferId
from kvledger.ledger.ids import stamped_id
from kvledger.ledger.limits import DEFAULT_DEFER_TIMEOUT_S


@dataclass(frozen=True)
class SynthConfig:
    transfers: int = 1000
    concurrency: int = 64
    layers: int = 32
    layers_per_step: int = 32
    blocks_per_request: int = 4
    consumer_ranks: int = 2
    write_fraction: float = 0.5
    fault_rate: float = 0.0
    defer_timeout_s: float = DEFAULT_DEFER_TIMEOUT_S
    step_s: float = 0.001
    producer: str = "prefill-0/tp0"
    consumer: str = "decode-0/tp0"
    seq_assigned: bool = True
    stamped: bool = True
    """Transfer ids are stamped (ledger/ids.py) as kvledger's proxy issues them: issued at the transfer's
    start, with the transfer's number as their random bits (no draw: the rest of the log is the same either
    way). False: `tx-{number:08x}`, unstamped, as a third-party proxy's ids are to the fold."""
    first_transfer: int = 0
    """The first transfer's number: engines of one fleet given apart ranges have apart ids and request ids."""
    clock_start: float = 1_700_000_000.0
    """The first event's time (unix seconds)."""


def synth_transfer_id(cfg: SynthConfig, n: int, start: float) -> TransferId:
    """The id of transfer number `n`, starting at `start` (see `SynthConfig.stamped`)."""
    return stamped_id(start, n) if cfg.stamped else TransferId(f"tx-{n:08x}")


def _transfer_events(cfg: SynthConfig, rng: random.Random, n: int, start: float) -> list[list[Event]]:
    """One transfer's events as a list of steps; each step is a list of events."""
    tid = synth_transfer_id(cfg, n, start)
    p_req, c_req = ReqId(f"p-{n}"), ReqId(f"c-{n}")
    # Block ids come from a bounded pool, as from vLLM's allocator; slots recycle long after
    # a transfer ends (8x the concurrency), so they never collide in time.
    slot = n % (8 * cfg.concurrency)
    p_blocks = tuple(range(slot * cfg.blocks_per_request, (slot + 1) * cfg.blocks_per_request))
    c_blocks = p_blocks
    deadline = start + cfg.defer_timeout_s
    P, C = cfg.producer, cfg.consumer
    write = rng.random() < cfg.write_fraction
    mode: Mode = "write" if write else "read"
    fault = rng.random() < cfg.fault_rate
    fault_kind = rng.choice(("transient", "terminal", "lost", "duplicate", "early")) if fault else ""
    t = start
    steps: list[list[Event]] = []

    def tick() -> float:
        nonlocal t
        t += cfg.step_s
        return t

    p_map = Map(ts=tick(), source=P, transfer_id=tid, request_id=p_req, role="producer", mode=mode,
                block_ids=p_blocks, deadline=deadline, peer="127.0.0.1:7000",
                acks_expected=1 if write else cfg.consumer_ranks)  # fmt: skip
    c_map = Map(ts=tick(), source=C, transfer_id=tid, request_id=c_req, role="consumer", mode=mode,
                block_ids=c_blocks, remote_block_ids=p_blocks, deadline=deadline,
                peer="127.0.0.1:7100")  # fmt: skip
    if fault_kind == "early":
        early = Ack(ts=tick(), source=C, transfer_id=tid, what="recv") if write else None
        steps.append([p_map] if early is None else [early, p_map])
        steps.append([c_map])
    else:
        steps.append([p_map])
        steps.append([c_map])
    if write:
        for first in range(0, cfg.layers, cfg.layers_per_step):
            layers = tuple(range(first, min(cfg.layers, first + cfg.layers_per_step)))
            step: list[Event] = [Schedule(ts=tick(), source=P, transfer_id=tid, op="write", layers=layers)]
            if fault_kind == "transient" and first == 0:
                step.append(Fail(ts=tick(), source=P, transfer_id=tid, reason="SQ full", retryable=True))
                retry = Schedule(ts=tick(), source=P, transfer_id=tid, op="write", layers=layers, attempt=1)
                step.append(retry)
            step.append(Ack(ts=tick(), source=P, transfer_id=tid, what="write", layers=layers))
            if fault_kind == "duplicate" and first == 0:
                step.append(Ack(ts=tick(), source=P, transfer_id=tid, what="write", layers=layers))
            steps.append(step)
        if fault_kind == "terminal":
            steps.append([Fail(ts=tick(), source=P, transfer_id=tid, reason="write failed")])
            steps.append([Fail(ts=tick(), source=C, transfer_id=tid, reason="write_failed from peer")])
            return steps
        steps.append([Seal(ts=tick(), source=P, transfer_id=tid, expected=cfg.layers)])
        if fault_kind == "lost":
            steps.append([Expire(ts=deadline, source=C, transfer_id=tid, deadline="transfer")])
            return steps
        if fault_kind != "early":
            steps.append([Ack(ts=tick(), source=C, transfer_id=tid, what="recv")])
        return steps
    step = [Schedule(ts=tick(), source=C, transfer_id=tid, op="read")]
    if fault_kind == "transient":
        step.append(Fail(ts=tick(), source=C, transfer_id=tid, reason="SQ full", retryable=True))
        step.append(Schedule(ts=tick(), source=C, transfer_id=tid, op="read", attempt=1))
    steps.append(step)
    if fault_kind == "terminal":
        steps.append([Fail(ts=tick(), source=C, transfer_id=tid, reason="read failed")])
    else:
        steps.append([Ack(ts=tick(), source=C, transfer_id=tid, what="read")])
    if fault_kind == "lost":
        steps.append([Expire(ts=deadline, source=P, transfer_id=tid, deadline="defer")])
        return steps
    releases: list[Event] = [
        Ack(ts=tick(), source=P, transfer_id=tid, what="release", rank=rank) for rank in range(cfg.consumer_ranks)
    ]
    if fault_kind == "duplicate":
        releases.append(Ack(ts=tick(), source=P, transfer_id=tid, what="release", rank=0))
    steps.append(releases)
    return steps


def generate(cfg: SynthConfig, seed: int = 0) -> Iterator[Event]:
    """Yield the events of `cfg.transfers` transfers, `cfg.concurrency` in flight at a time.

    With `seq_assigned` each event carries its seq in its own source's log, so the
    stream can be appended to per-source logs or written as an incident log as is.
    """
    rng = random.Random(seed)
    next_seq = {cfg.producer: 1, cfg.consumer: 1}
    inflight: list[Iterator[list[Event]]] = []
    started = 0
    clock = cfg.clock_start
    while started < cfg.transfers or inflight:
        while started < cfg.transfers and len(inflight) < cfg.concurrency:
            inflight.append(iter(_transfer_events(cfg, rng, cfg.first_transfer + started, clock)))
            started += 1
        i = rng.randrange(len(inflight))
        step = next(inflight[i], None)
        if step is None:
            inflight[i] = inflight[-1]
            inflight.pop()
            continue
        for event in step:
            clock += cfg.step_s
            seq = 0
            if cfg.seq_assigned:
                seq = next_seq[event.source]
                next_seq[event.source] = seq + 1
            # Expires keep their deadline as ts: the clock saw it pass then, not now.
            ts = event.ts if isinstance(event, Expire) else clock
            yield msgspec.structs.replace(event, seq=seq, ts=ts)
