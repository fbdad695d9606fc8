"""A two-engine P/D harness for tests: each side is a scheduler core plus one worker core, stepped the way
vLLM steps them (metadata -> bind -> start_load -> forward (save per layer) -> wait_for_save -> get_finished
-> update_connector_output), over real ZMQ on loopback with the tcp transport."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from kvledger.connector.assemble import build_scheduler, build_worker
from kvledger.connector.config import ConnectorConfig, PeerEngine
from kvledger.connector.scheduler import SchedulerCore, WorkerOutcome
from kvledger.connector.worker import WorkerCore
from kvledger.ledger.events import Mode, ReqId, Role

STEP_PAUSE_S = 0.002
"""Between steps, so that threads move bytes; not a timeout."""


@dataclass(frozen=True)
class EnginePorts:
    handshake: int
    notify: int
    transport: int

    def as_peer(self) -> PeerEngine:
        return PeerEngine(
            host="127.0.0.1", handshake_port=self.handshake, notify_port=self.notify, transport_port=self.transport
        )


def make_config(role: Role, mode: Mode, mine: EnginePorts, theirs: EnginePorts, **overrides: Any) -> ConnectorConfig:
    return ConnectorConfig(
        role=role,
        mode=mode,
        engine_id="prefill-0" if role == "producer" else "decode-0",
        handshake_port=mine.handshake,
        notify_port=mine.notify,
        transport_port=mine.transport,
        peers=(theirs.as_peer(),),
        **overrides,
    )


NUM_BLOCKS = 32
BLOCK_SIZE = 4


def make_caches(fill: bool, seed: int) -> dict[str, torch.Tensor]:
    """Three layers of different geometry: separated K/V, interleaved K/V, and an index-only layer."""
    g = torch.Generator().manual_seed(seed)

    def tensor(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if fill:
            return torch.randn(*shape, generator=g).to(dtype)
        return torch.zeros(*shape, dtype=dtype)

    return {
        "layers.0.attn": tensor(2, NUM_BLOCKS, BLOCK_SIZE, 2, 8),
        "layers.1.attn": tensor(NUM_BLOCKS, 2, BLOCK_SIZE, 2, 8, dtype=torch.bfloat16),
        "layers.2.indexer": tensor(NUM_BLOCKS, BLOCK_SIZE, 16, dtype=torch.float16),
    }


def block_bytes(caches: dict[str, torch.Tensor], name: str, block: int) -> bytes:
    tensor = caches[name]
    view = tensor[:, block] if tensor.shape[0] == 2 and name.endswith("0.attn") else tensor[block]
    data: bytes = view.contiguous().view(torch.uint8).numpy().tobytes()
    return data


@dataclass
class Side:
    scheduler: SchedulerCore
    worker: WorkerCore
    caches: dict[str, torch.Tensor]
    finished_pending: set[ReqId] = field(default_factory=set)
    """Requests vLLM finished since the last step: the next step's finished_req_ids."""
    reported_sending: Counter[ReqId] = field(default_factory=Counter)
    reported_recving: Counter[ReqId] = field(default_factory=Counter)
    failed_recving: set[ReqId] = field(default_factory=set)
    invalid_blocks: set[int] = field(default_factory=set)
    saves: int = 0
    tick_in_meta: bool = False
    """Give build_meta the clock, as the adapter does (the tick and lease renewals run there)."""

    @classmethod
    def build(cls, config: ConnectorConfig, fill: bool, seed: int) -> Side:
        scheduler = build_scheduler(config)
        worker = build_worker(config)
        caches = make_caches(fill, seed)
        worker.register_kv_caches(caches, NUM_BLOCKS)
        # As vLLM's EngineCore hands the workers' handshake metadata to the scheduler half once they registered.
        scheduler.set_generations({config.tp_rank: worker.generation})
        return cls(scheduler, worker, caches)

    def step(self, now: float) -> WorkerOutcome:
        meta = self.scheduler.build_meta(now if self.tick_in_meta else None)
        self.worker.bind(meta, now)
        self.worker.start_load(now)
        if meta.save:
            for name in self.caches:  # the forward: one save per layer
                self.worker.save_layer(name)
            self.saves += 1
        self.worker.wait_for_save(now)
        finished, self.finished_pending = self.finished_pending, set()
        sending, recving, failed = self.worker.get_finished(finished, now)
        errors = self.worker.take_load_errors()
        outcome = self.scheduler.on_worker_output(sending, recving, failed, now)
        self.reported_sending.update(outcome.finished_sending)
        self.reported_recving.update(outcome.finished_recving)
        self.failed_recving |= outcome.failed_recving
        self.invalid_blocks |= outcome.invalid_block_ids | errors
        return outcome

    def close(self) -> None:
        self.worker.close()


class Ticks:
    """A hand-moved clock for `run_until`: each call advances it by `step_s`; `now` can be moved by hand."""

    def __init__(self, start: float = 1000.0, step_s: float = 0.01) -> None:
        self.now, self.step_s = start, step_s

    def __call__(self) -> float:
        self.now += self.step_s
        return self.now


def run_until(sides: list[Side], done: Any, *, steps_max: int = 3000, clock: Any = time.time) -> int:
    """Step every side until `done()`; returns the number of rounds (fails the test if it never is)."""
    for rounds in range(steps_max):
        if done():
            return rounds
        now = clock()
        for side in sides:
            side.step(now)
        time.sleep(STEP_PAUSE_S)
    raise AssertionError(f"not done after {steps_max} rounds")
