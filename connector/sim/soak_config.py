"""What a soak is asked to do (`SoakConfig`) and what it found (`SoakResult`).

A soak is the storm stretched over hours of simulated time: the same engines, wire and faults, plus what
only long runs meet (re-asks after preemption and after failed loads, a proxy that reuses transfer ids,
engines that die and come back), with the clock jumping across idle gaps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, TypeAlias

from kvledger.connector.sim.config import FAULT_KINDS, FaultKind, StormConfig, StormResult
from kvledger.connector.sim.faults import horizon_s
from kvledger.connector.sim.limits import REUSE_SOON_MAX_S
from kvledger.ledger.limits import MAINTENANCE_INTERVAL_S

SoakFaultKind: TypeAlias = Literal["preempt_reask", "recompute", "id_reuse", "restart"]
SOAK_FAULT_KINDS: tuple[SoakFaultKind, ...] = ("preempt_reask", "recompute", "id_reuse", "restart")
"""preempt_reask: vLLM preempts a consumer request after its KV loaded (blocks freed, num_computed_tokens
back to 0) and asks get_num_new_matched_tokens again seconds to minutes later; recompute:
kv_load_failure_policy "recompute", so every failed load is asked again at once; id_reuse: the proxy sends
a new request carrying a transfer id used seconds, minutes or hours before; restart: an engine dies and
comes back, its ledgers reopened from `ledger_url`."""

STORM_KINDS_IN_SOAK: tuple[FaultKind, ...] = tuple(
    k for k in FAULT_KINDS if k not in ("peer_death", "late_reader", "peer_restart_layout")
)
"""The storm's kinds a soak injects too. peer_death (an engine gone for good) is the storm's: a soak's
engines come back (`restart`). late_reader is the storm's too: its waits (past the defer deadline) would
stretch every burst's window, and the soak is about memory over hours, not about leases. So is
peer_restart_layout: the soak's restarts come back with the same layout (and a new generation each)."""

LEDGERS = 4
"""Two engines, each a scheduler ledger and a worker ledger."""


@dataclass(frozen=True)
class SoakConfig(StormConfig):
    """`requests` is not used (traffic follows the clock: bursts until `sim_hours`); `concurrency` only sizes
    the block pools (`num_blocks` 0 picks concurrency x blocks_per_request x 2)."""

    faults: frozenset[FaultKind] = frozenset(STORM_KINDS_IN_SOAK)
    concurrency: int = 256
    step_s: float = 0.05
    """Coarser than the storm's 10 ms (a loaded engine's step): five times fewer rounds per burst, while every
    timeout still spans 20 rounds or more and the round-counted faults (reorder, early) stay well inside
    transfer_timeout."""
    sim_hours: float = 6.0
    soak_faults: frozenset[SoakFaultKind] = frozenset(SOAK_FAULT_KINDS)
    burst_requests_max: int = 48
    """Requests arriving together (1 to this many, uniformly)."""
    burst_gap_min_s: float = 25.0
    burst_gap_max_s: float = 75.0
    """Simulated seconds from one burst to the next (uniformly)."""
    decode_min_s: float = 1.0
    decode_max_s: float = 120.0
    """How long a consumer request decodes after its KV arrived (or it computed locally)."""
    preempt_rate: float = 0.15
    """Probability that vLLM preempts a decoding consumer request (again, up to `preemptions_max`)."""
    preemptions_max: int = 3
    reask_delay_min_s: float = 1.0
    reask_delay_max_s: float = 1200.0
    """A preempted request is asked again this long after (log-uniformly: seconds to minutes)."""
    reuse_rate: float = 0.05
    """Per fresh request, the chance that the proxy sends its transfer id again within seconds; per burst
    request, the chance that it carries a transfer id used minutes or hours before."""
    restart_gap_min_s: float = 1200.0
    restart_gap_max_s: float = 3600.0
    """Simulated seconds between engine deaths (the engines take turns)."""
    downtime_min_s: float = 5.0
    downtime_max_s: float = 180.0
    """How long a dead engine stays down before it restarts."""
    tombstones_max: int = 32
    """Each running ledger's tombstone bound (`LedgerState.tombstones_max`), small so that generations rotate
    many times: tombstones keep the last `tombstones_max / 2` to `tombstones_max` compacted sides exact,
    about `tombstones_max / rate` seconds of history at a ledger's rate of new sides; older ids are
    answered by the id memory (ledger/idmemory.py)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        unknown = set(self.soak_faults) - set(SOAK_FAULT_KINDS)
        if unknown:
            raise ValueError(f"unknown soak fault kinds {sorted(unknown)}; known: {list(SOAK_FAULT_KINDS)}")
        if "peer_death" in self.faults:
            raise ValueError("a soak's engines come back: use the 'restart' soak fault, not peer_death")
        if self.sim_hours <= 0 or self.burst_requests_max < 1 or self.tombstones_max < 2:
            raise ValueError("sim_hours must be > 0, burst_requests_max >= 1 and tombstones_max >= 2")
        if not self.burst_window_s <= self.burst_gap_min_s <= self.burst_gap_max_s:
            raise ValueError(
                f"burst_gap_min_s must be at least a burst's window ({self.burst_window_s:.1f} s) for the side "
                "bound to hold, and at most burst_gap_max_s"
            )
        for low, high in (
            (self.decode_min_s, self.decode_max_s),
            (self.reask_delay_min_s, self.reask_delay_max_s),
            (self.restart_gap_min_s, self.restart_gap_max_s),
            (self.downtime_min_s, self.downtime_max_s),
        ):
            if not 0 < low <= high:
                raise ValueError(f"ranges must satisfy 0 < low <= high, got ({low}, {high})")

    @property
    def burst_window_s(self) -> float:
        """How long a burst's sides stay whole in a running ledger: its follow-up reuses arrive within
        `REUSE_SOON_MAX_S`, every fault on them has played out `horizon_s` later, a decided side is forgotten
        `defer_timeout_s` (the connector's retention) after its last event, at the next maintenance."""
        return REUSE_SOON_MAX_S + horizon_s(self) + self.defer_timeout_s + MAINTENANCE_INTERVAL_S + self.step_s

    @property
    def whole_sides_max(self) -> int:
        """Sides one running ledger holds whole (live, decided, never mapped) at the end of any round.

        Bursts are at least `burst_window_s` apart, so at most one burst's sides are whole: its requests and
        their follow-up reuses, one side each per ledger (a reuse's refused map lands on the first owner's
        side). At a restart, the sides the dead engine left live come back whole at most once more for each
        of those: 2 x 2 x `burst_requests_max`. Re-asks add none (they append no event)."""
        return 4 * self.burst_requests_max

    @property
    def tracked_sides_bound_per_ledger(self) -> int:
        """Whole sides plus tombstones (fewer than `tombstones_max`): independent of how long the run is."""
        return self.whole_sides_max + self.tombstones_max

    @property
    def tracked_sides_bound(self) -> int:
        return LEDGERS * self.tracked_sides_bound_per_ledger

    @property
    def end_ts(self) -> float:
        return self.start_ts + self.sim_hours * 3600.0

    @property
    def busy_max_s(self) -> float:
        """A connector busy for longer than this without a pause is stuck (bursts are further apart)."""
        return max(self.burst_gap_min_s, 2 * self.burst_window_s)


@dataclass
class SoakResult(StormResult):
    """The storm's figures for the whole soak, plus what only long runs show."""

    sim_hours: float = 0.0
    bursts: int = 0
    stepped_seconds: float = 0.0
    """Simulated seconds stepped round by round; the rest of `sim_seconds` the clock jumped (nothing to do)."""
    jumps: int = 0
    reasks: int = 0
    """Re-asks of a consumer request after its KV loaded (vLLM preempted it)."""
    recomputes: int = 0
    """Re-asks after a failed load (kv_load_failure_policy "recompute")."""
    local_computes: int = 0
    """Consumer requests (or re-asks) that vLLM computed locally: get_num_new_matched_tokens said (0, False)."""
    loaded_twice: int = 0
    """Requests that started a second remote load (must be 0)."""
    second_alloc_claims: int = 0
    """update_state_after_alloc after a load (num_external_tokens 0) that claimed the load again (must be 0)."""
    id_reuses: int = 0
    """Requests that carried a transfer id used before."""
    id_reuses_refused: dict[str, int] = field(default_factory=dict)
    """Per side (producer, consumer): reused ids that side refused."""
    id_reuse_answers: dict[str, int] = field(default_factory=dict)
    """`side:regime` -> count: how the refusing ledger knew (live, whole decided side, tombstone, id memory)."""
    reuses_across_restart: int = 0
    """Reused ids refused by an engine that had restarted since it mapped them."""
    reuses_wrongly_accepted: list[str] = field(default_factory=list)
    """`side:transfer id:request` accepted by an engine that had accepted that id before (must be empty)."""
    unmapped_ids_refused: list[str] = field(default_factory=list)
    """Ids refused by an engine that never accepted them: an id-memory false positive (must be empty)."""
    restarts: dict[str, int] = field(default_factory=dict)
    tombstones_evicted: dict[str, int] = field(default_factory=dict)
    """Per running ledger at the end (counted since its last restart): tombstones evicted past the bound."""
    tombstone_generations: int = 0
    """Tombstone generations evicted over the run, all ledgers (evictions / (tombstones_max / 2))."""
    peak_tracked_sides: int = 0
    peak_tracked_sides_per_ledger: dict[str, int] = field(default_factory=dict)
    tracked_sides_bound: int = 0
    tracked_sides_bound_per_ledger: int = 0
    refold_tracked_sides: int = 0
    """The most sides a restart's reopened ledger held before its first step (part of the peak)."""
    compaction_invariant: bool = False
    """The offline replay's releases and findings are the same with compaction (default and frequent) and
    without it."""
    replay_compacted_sides: int = 0
    """Sides the default offline replay compacted (so compaction did run)."""
    bookkeeping_left: list[str] = field(default_factory=list)
    """Per-request state left in a live connector at the end (request index, unreported sends, in-flight
    handles, peers): it would grow with the run."""


def log_uniform(low: float, high: float, draw: float) -> float:
    """The value at `draw` (in [0, 1)) of a log-uniform distribution on [low, high]: seconds to minutes."""
    return math.exp(math.log(low) + draw * (math.log(high) - math.log(low)))
